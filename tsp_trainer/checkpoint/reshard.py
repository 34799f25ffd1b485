"""Layout-free training state, and resuming it under another layout (D, DP, scheme or ZeRO stage).

DeepSpeed's own files (deepspeed/) hold ZeRO's flat optimizer partitions, which only the layout
that wrote them can read; they stay the exact path for a same-layout resume. Beside them every
checkpoint holds the same state in layout-free form, in the self-describing shard format of
checkpoint/shards.py (each tensor's ShardSpec recorded, one file per model-parallel rank, written
by dp_rank 0 of each group):

    model/model-tspXXX-of-YYY.safetensors   the (low-precision) model weights, our names
    optim/optim-tspXXX-of-YYY.safetensors   "exp_avg/<name>", "exp_avg_sq/<name>" (AdamW moments,
                                            fp32) and, when the weights are not fp32, the fp32
                                            master "fp32/<name>"; extra metadata: Adam's step
                                            count per param group

ZeRO 1/2 shard the moments over DP; DeepSpeed's public helpers `safe_get_full_optimizer_state` /
`safe_get_full_fp32_param` assemble one parameter's full (TSP-local) tensor with an all-reduce over
the DP group, and `safe_set_full_*` write back this rank's fragment (no communication). Under ZeRO
stage 0 in fp32 the torch optimizer holds the moments per parameter and is read directly.

Must not import trainer; its DeepSpeed calls live in engine/zero_state.py (imported lazily there).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tsp_trainer.engine.zero_state import (get_full_fp32, get_full_optimizer_state,
                                           link_optimizer_state, set_full_fp32,
                                           set_full_optimizer_state)
from tsp_trainer.checkpoint.shards import (read_extra, read_local_state_dict, shard_file_name,
                                           write_shard)
from tsp_trainer.parallel.schemes import Parallelized

MOMENTS = ("exp_avg", "exp_avg_sq")
OPTIM = "optim"
# Layout keys that decide whether DeepSpeed's own files can be loaded as they are.
LAYOUT_KEYS = ("scheme", "tsp_degree", "dp_degree", "zero_stage")


# -- save -------------------------------------------------------------------------------------------
def write_layout_free_state(folder: Path, par: Parallelized, optimizer: torch.optim.Optimizer) -> None:
    """Collective (every rank, same point): write model/ and optim/ shards into `folder`.
    `optimizer` is the torch optimizer handed to DeepSpeed (ZeRO swaps its params for flat fp32
    partitions)."""
    mesh, ranks = par.mesh, _axis_ranks(par)
    writer = mesh.dp_rank == 0
    steps = adam_steps(optimizer)
    if any(steps):
        link_optimizer_state(optimizer, par.model.parameters())
    tensors = {}
    for name, p in par.model.named_parameters():
        for key in (MOMENTS if any(steps) else ()):     # no moments before the first update
            t = get_full_optimizer_state(p, optimizer, key)      # collective over dp under ZeRO
            if writer:
                tensors[f"{key}/{name}"] = t.cpu()
        if p.dtype != torch.float32:
            t = get_full_fp32(p)
            if writer:
                tensors[f"fp32/{name}"] = t.cpu()
    if not writer:
        return
    write_shard(folder / "model" / shard_file_name(mesh.tsp_rank, mesh.dims.tsp),
                dict(par.model.state_dict()), par.specs, ranks)
    specs = {key: par.specs[key.split("/", 1)[1]] for key in tensors}
    write_shard(folder / OPTIM / shard_file_name(mesh.tsp_rank, mesh.dims.tsp, OPTIM), tensors,
                specs, ranks, extra={"adam_steps": steps, "moments": list(MOMENTS) if any(steps) else [],
                                     "fp32_master": any(k.startswith("fp32/") for k in tensors)})


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
        raise ValueError(f"checkpoint {folder} has no layout-free optimizer state ({OPTIM}/): it "
                         "was written before tsp_trainer saved one and can only be resumed under "
                         "the layout that wrote it")
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
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name])
            set_full_fp32(p, state.get(f"fp32/{name}", weights[name]).float())
    if extra["moments"]:
        _init_adam_state(optimizer, params.values(), extra["adam_steps"], extra["moments"])
        for name, p in params.items():
            for key in extra["moments"]:
                set_full_optimizer_state(p, optimizer, key, state[f"{key}/{name}"])


def _init_adam_state(optimizer, params, steps: list[int], moments) -> None:
    """Create the optimizer's state for its (flat) params, as AdamW's first step would, and link
    ZeRO's per-parameter views onto it."""
    for group, step in zip(optimizer.param_groups, steps):
        for flat in group["params"]:
            optimizer.state[flat] = {"step": torch.tensor(float(step)),
                                     **{k: torch.zeros_like(flat) for k in moments}}
    link_optimizer_state(optimizer, params)


def apply_scheduler_lr(optimizer: torch.optim.Optimizer, scheduler) -> None:
    """A restored LR scheduler sets the rate only at its next step(); the update about to run must
    already use it (a same-layout resume gets it from DeepSpeed's optimizer state instead)."""
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr


def _axis_ranks(par: Parallelized) -> dict[str, int]:
    return {axis: comm.rank for axis, comm in par.axis_comms.items()}
