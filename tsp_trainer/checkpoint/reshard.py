"""Layout-free training state: the one copy of the model and optimizer state every checkpoint holds,
and resuming it under the same or another layout (D, DP, scheme or ZeRO stage).

Every checkpoint holds the state once, in the self-describing shard format of checkpoint/shards.py
(each tensor's ShardSpec recorded):

    model/model-tspXXX-of-YYY[-partPPP-of-QQQ].safetensors   the model weights, our names
    optim/optim-tspXXX-of-YYY[-partPPP-of-QQQ].safetensors   "exp_avg/<name>", "exp_avg_sq/<name>"
                                            (AdamW moments, fp32) and, when the weights are not
                                            fp32, the fp32 master "fp32/<name>"; extra metadata:
                                            Adam's step count per param group

Who writes what: each distinct shard once. A tensor sharded on one model-parallel axis is written
by the ranks at index 0 of the other axes; a replicated one (norms) by model-parallel rank 0 only.
Within a dp group (same shard, other data) the tensors are dealt out by bytes over the dp ranks,
each writing its own part file, so writing and hashing are spread over every rank.

ZeRO 1/2 shard the moments over DP: saving assembles one parameter's full (TSP-local) tensor on
the dp rank that writes it, from the ranks' fragments, with one reduce over dp into a reused buffer
(engine/zero_state.py::full_state_on_owner; with dp = 1 the live partition is read as it is), and
loading writes back this rank's fragment with DeepSpeed's `safe_set_full_*` (no communication).
Under ZeRO stage 0 the torch optimizer holds the moments per parameter and is read directly.
ZeRO-3 (sp, ulysses) partitions the weights too, over every rank: each tensor, weights included, is
assembled on its writer by one reduce over all ranks (engine/zero_state.py zero3_full_on_owner),
every rank taking part for every parameter, and loading writes this rank's partitions. With
zero.offload_optimizer=cpu the fp32 master and moments ZeRO keeps (all stages) are host tensors,
read and written by the same accessors.
Loading copies values (no arithmetic), so a resume under the same layout continues bit for bit.

Must not import trainer; its DeepSpeed calls live in engine/zero_state.py (imported lazily there).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from tsp_trainer.engine.zero_state import (fresh_adam_step, full_state_on_owner, is_zero3,
                                           link_optimizer_state, replay_cpu_adam_steps, set_full_fp32,
                                           set_full_optimizer_state, zero3_adam_steps,
                                           zero3_full_on_owner, zero3_init_adam_state, zero3_load)
from tsp_trainer.checkpoint.shards import (read_extra, read_local_state_dict, shard_file_name,
                                           shard_layout, write_layout_file)
from tsp_trainer.parallel.schemes import Parallelized

MOMENTS = ("exp_avg", "exp_avg_sq")
OPTIM = "optim"
# Layout keys that decide whether the saved per-rank state (loader, RNG) maps 1:1 onto this run.
LAYOUT_KEYS = ("scheme", "tsp_degree", "dp_degree", "zero_stage")

# (name, tensor, kind) -> the tensor to write. kind: "live" (training will change it: an async save
# must copy it), "scratch" (a buffer the snapshot reuses: always copied) or "fresh" (nothing else
# holds it).
HostCopy = Callable[[str, torch.Tensor, str], torch.Tensor]


def _sync_keep(name: str, t: torch.Tensor, kind: str) -> torch.Tensor:
    """A synchronous save writes before training continues: only reused buffers are copied."""
    return t.clone() if kind == "scratch" else t


@dataclass
class ShardFile:
    """One file of the layout-free state that this rank writes (its tensors already snapshotted)."""

    rel: str                           # path inside the checkpoint folder
    tensors: dict[str, torch.Tensor]
    layout: dict[str, dict]
    extra: dict | None = None

    def write(self, folder: Path) -> dict[str, dict]:
        """Write into `folder`; returns {rel: {"bytes", "sha256"}} for the manifest."""
        return {self.rel: write_layout_file(Path(folder) / self.rel, self.tensors, self.layout,
                                            extra=self.extra)}


# -- save -------------------------------------------------------------------------------------------
def snapshot_layout_free_state(par: Parallelized, optimizer: torch.optim.Optimizer, *,
                               host_copy: HostCopy | None = None) -> list[ShardFile]:
    """Collective over each dp group (every rank, same point): this rank's share of model/ and
    optim/, as files to write. `optimizer` is the torch optimizer handed to DeepSpeed (ZeRO swaps
    its params for flat fp32 partitions). `host_copy` copies what is kept (an async save must not
    write live tensors); None keeps the tensors as they are (the caller writes before training
    continues)."""
    mesh, ranks = par.mesh, _axis_ranks(par)
    keep = host_copy or _sync_keep
    owner = write_owners(par)
    zero3 = any(is_zero3(p) for p in par.model.parameters())
    steps = zero3_adam_steps(optimizer, par.model.parameters()) if zero3 else adam_steps(optimizer)
    if any(steps) and not zero3:
        link_optimizer_state(optimizer, par.model.parameters())
    keys = (list(MOMENTS) if any(steps) else []) + [None]        # None: the fp32 master weights
    if zero3:
        model, optim = _zero3_tensors(par, keys, keep)
    else:
        model, optim = _tensors(par, optimizer, owner, keys, keep)
    part = {"part": mesh.dp_rank, "parts": mesh.dims.dp}
    extra = {"adam_steps": steps, "moments": list(MOMENTS) if any(steps) else [],
             "fp32_master": any(p.dtype != torch.float32 for p in par.model.parameters())}
    files = []
    if model:
        files.append(ShardFile(f"model/{shard_file_name(mesh.tsp_rank, mesh.dims.tsp, **part)}",
                               model, shard_layout(model, par.specs, ranks)))
    if optim:
        files.append(ShardFile(f"{OPTIM}/{shard_file_name(mesh.tsp_rank, mesh.dims.tsp, OPTIM, **part)}",
                               optim, shard_layout(optim, par.specs, ranks), extra))
    return files


def _tensors(par: Parallelized, optimizer, owner: dict[str, int], keys: list, keep: HostCopy):
    """(model tensors, optim tensors) this rank writes, ZeRO 0-2: collective over its dp group."""
    mesh = par.mesh
    params = [(n, p) for n, p in par.model.named_parameters() if n in owner]   # others: no collective
    # one flat fp32 buffer on the compute device for the dp gathers, reused parameter by parameter
    scratch = torch.empty(max((p.numel() for _, p in params), default=0), dtype=torch.float32,
                          device=next(par.model.parameters()).device) if mesh.dims.dp > 1 else None
    optim: dict[str, torch.Tensor] = {}
    for name, p in params:
        for key in keys:
            if key is None and p.dtype == torch.float32:         # the weights are the master
                continue
            t, in_scratch = full_state_on_owner(p, optimizer, key, dp=mesh.dp, owner=owner[name],
                                                scratch=scratch)  # collective over dp under ZeRO
            if t is not None:
                label = f"{key or 'fp32'}/{name}"
                optim[label] = keep(label, t, "scratch" if in_scratch else "live")
    model = {name: keep(name, t.detach(), "live") for name, t in par.model.state_dict().items()
             if owner.get(name) == mesh.dp_rank}
    return model, optim


def _zero3_tensors(par: Parallelized, keys: list, keep: HostCopy):
    """(model tensors, optim tensors) this rank writes under ZeRO-3: every rank takes part in one
    reduce over all ranks per tensor, in parameter order; the writers are those of write_owners
    as the model-parallel rank 0 of each dp group deals them (every tensor is whole on the axis)."""
    mesh = par.mesh
    named = dict(par.model.named_parameters(remove_duplicate=False))   # a tied weight: both names
    writers = _writers_at_axis_rank_0(named, mesh.dims)
    w = mesh.world.size
    scratch = torch.empty(max(w * -(-p.ds_numel // w) for p in named.values()), dtype=torch.float32,
                          device=mesh.device)
    model, optim = {}, {}
    for name, p in named.items():
        t, _ = zero3_full_on_owner(p, None, world=mesh.world, owner=writers[name], scratch=scratch,
                                   weight=True)
        if t is not None:
            model[name] = keep(name, t.to(p.dtype), "scratch" if p.dtype == torch.float32 else "fresh")
    for name, p in par.model.named_parameters():
        for key in keys:
            if key is None and p.dtype == torch.float32:         # the weights are the master
                continue
            t, _ = zero3_full_on_owner(p, key, world=mesh.world, owner=writers[name], scratch=scratch)
            if t is not None:
                label = f"{key or 'fp32'}/{name}"
                optim[label] = keep(label, t, "scratch")
    return model, optim


def _writers_at_axis_rank_0(named: dict[str, torch.nn.Parameter], dims) -> dict[str, int]:
    """name -> the global rank that writes it when every tensor is whole on the axis (ZeRO-3): the
    dp rank of model-parallel rank 0 that write_owners' dealing gives it, by whole sizes."""
    sizes = [(p.ds_numel * p.element_size(), name) for name, p in named.items()]
    return {name: dims.dp_group_ranks(0)[d] for name, d in _deal(sizes, dims.dp).items()}


def write_owners(par: Parallelized) -> dict[str, int]:
    """state-dict name -> the dp rank of this rank's dp group that writes it; names this group does
    not write (another model-parallel rank holds the same values) are absent. Deterministic, the
    same on every rank of a dp group: tensors dealt largest first to the least loaded dp rank."""
    ranks = _axis_ranks(par)
    mine = []
    for name, t in par.model.state_dict().items():
        spec = par.specs[name]
        others = [axis for axis in ranks if axis != spec.axis or spec.dim is None]
        first_copy = spec.dim is None or ranks.get(spec.axis, 0) % spec.repeat == 0   # K/V head copies
        if all(ranks[axis] == 0 for axis in others) and first_copy:
            mine.append((t.numel() * t.element_size(), name))
    return _deal(mine, par.mesh.dims.dp)


def _deal(sized: list[tuple[int, str]], dp: int) -> dict[str, int]:
    """(bytes, name) pairs -> name: dp rank, largest first to the least loaded rank."""
    load = [0] * dp
    owner = {}
    for nbytes, name in sorted(sized, key=lambda x: (-x[0], x[1])):
        rank = min(range(len(load)), key=lambda r: (load[r], r))
        owner[name] = rank
        load[rank] += nbytes
    return owner


def adam_steps(optimizer: torch.optim.Optimizer) -> list[int]:
    """Adam's step count per param group (0 before the first update; skipped steps don't count)."""
    steps = []
    for group in optimizer.param_groups:
        state = optimizer.state.get(group["params"][0], {})
        steps.append(int(state["step"]) if "step" in state else 0)
    return steps


# -- resume under another layout --------------------------------------------------------------------
def layout_changed(saved: dict, current: dict) -> bool:
    """Whether DeepSpeed's files of `saved` cannot be loaded by `current` (meta.json "layout")."""
    return any(saved.get(k, current[k]) != current[k] for k in LAYOUT_KEYS)


def check_layout_change(saved: dict, current: dict, *, policy: str, path: Path) -> None:
    """data.on_layout_change=refuse stops a resume under another DP degree, before anything loads."""
    if saved["dp_degree"] != current["dp_degree"] and policy == "refuse":
        raise ValueError(
            f"checkpoint {path} was saved with dp_degree={saved['dp_degree']} but this run has "
            f"dp_degree={current['dp_degree']}: the data loaders' positions cannot carry over "
            "exactly and data.on_layout_change=refuse; set data.on_layout_change=restart to start "
            "the data stream over (see docs/data.md)")


def source_rank(saved: dict, dp_rank: int, tsp_rank: int) -> int:
    """The saved global rank whose per-rank state (data loader, RNG) this rank takes: the one at
    (dp_rank % old dp, tsp_rank % old D). With DP unchanged every DP rank gets its own loader back."""
    return (dp_rank % saved["dp_degree"]) * saved["tsp_degree"] + tsp_rank % saved["tsp_degree"]


def load_layout_free_state(folder: Path, par: Parallelized, optimizer: torch.optim.Optimizer) -> None:
    """Every rank: load its slice, under the current layout, of the model weights, the fp32
    master weights and the AdamW moments and step count. No collective."""
    folder = Path(folder)
    if not list((folder / OPTIM).glob(f"{OPTIM}-*.safetensors")):
        raise ValueError(f"checkpoint {folder} has no layout-free optimizer state ({OPTIM}/), "
                         "which a resume reads (DeepSpeed's own checkpoint files are not read); "
                         "export its weights with tsp-export "
                         "and start from them with model.init_from")
    params = dict(par.model.named_parameters())
    ranks = _axis_ranks(par)
    weights = read_local_state_dict(folder / "model", par.specs, ranks, list(params))
    extra = read_extra(folder / OPTIM, OPTIM)
    keys = [f"{k}/{n}" for n in params for k in extra["moments"]]
    keys += [f"fp32/{n}" for n in params] if extra["fp32_master"] else []
    state = read_local_state_dict(folder / OPTIM, par.specs, ranks, keys, OPTIM) if keys else {}
    if len(extra["adam_steps"]) != len(optimizer.param_groups):
        raise ValueError(f"checkpoint {folder} has {len(extra['adam_steps'])} optimizer param groups, "
                         f"this optimizer {len(optimizer.param_groups)}")
    if any(is_zero3(p) for p in params.values()):
        _load_zero3(par, optimizer, params, weights, state, extra)
        return
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name])
            set_full_fp32(p, state.get(f"fp32/{name}", weights[name]).float())
    if extra["moments"]:
        _init_adam_state(optimizer, params.values(), extra["adam_steps"], extra["moments"])
        for name, p in params.items():
            for key in extra["moments"]:
                set_full_optimizer_state(p, optimizer, key, state[f"{key}/{name}"])


def _load_zero3(par: Parallelized, optimizer, params: dict, weights: dict, state: dict, extra: dict) -> None:
    """ZeRO-3: this rank's partitions of the weights, fp32 master and moments (no collective);
    with the optimizer offloaded (DeepSpeedCPUAdam) its step counter replayed too."""
    if extra["moments"]:
        zero3_init_adam_state(optimizer, params.values(), extra["adam_steps"], extra["moments"])
        replay_cpu_adam_steps(optimizer, max(extra["adam_steps"], default=0))
    with torch.no_grad():
        for name, p in params.items():
            zero3_load(p, weights[name], state.get(f"fp32/{name}", weights[name]),
                       {k: state[f"{k}/{name}"] for k in extra["moments"]}, rank=par.mesh.world.rank)


def _init_adam_state(optimizer, params, steps: list[int], moments) -> None:
    """Create the optimizer's state for its (flat) params, as AdamW's first step would, and link
    ZeRO's per-parameter views onto it (DeepSpeedCPUAdam: its step counter replayed too)."""
    for group, step in zip(optimizer.param_groups, steps):
        for flat in group["params"]:
            optimizer.state[flat] = {"step": fresh_adam_step(optimizer, step),
                                     **{k: torch.zeros_like(flat) for k in moments}}
    replay_cpu_adam_steps(optimizer, max(steps, default=0))
    link_optimizer_state(optimizer, params)


def apply_scheduler_lr(optimizer: torch.optim.Optimizer, scheduler) -> None:
    """A restored LR scheduler sets the rate only at its next step(); the update about to run must
    already use it."""
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr


def _axis_ranks(par: Parallelized) -> dict[str, int]:
    return {axis: comm.rank for axis, comm in par.axis_comms.items()}
