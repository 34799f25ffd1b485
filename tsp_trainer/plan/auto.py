"""`auto` for parallel.tsp_recompute, train.activation_checkpointing, parallel.head_buckets,
train.checkpoint_segment_blocks, train.offload_activations, train.offload_prefetch,
parallel.checkpoint_replay_keeps, parallel.ulysses_head_chunks and train.attention_gqa: the fastest combination by the planner's predicted step time
(predict.py) whose predicted peak per process (model state + the activation peak of
activations.py and transients.py) fits the memory budget. An explicit value stays as written;
`auto` chooses the others around it.

    choice = choose_auto_settings(cfg, world_size=world, cuda=cuda)   # None: nothing is auto
    cfg = choice.apply(cfg)                    # ValueError above: nothing fits the budget
    log.info(choice.line())                    # auto: tsp_recompute=selective, ... (predicted peak ...)

Nested checkpointing (checkpoint_segment_blocks k > 1) costs one more forward of all but the last
block of every segment, so the ranking takes k = 1 whenever it fits and the smallest k of
layout.NESTING_CANDIDATES that does otherwise.

Activation offload (train.offload_activations `auto`) is weighed only when memory requires it:
first the candidates without it at the run's own segment length (k = 1 when that is auto) are
ranked as above, and the fastest that fits is the choice, so a run that fits without help runs as
it would with the offload off. When none fits, every candidate (offload off and on, every k) is
ranked, and the fastest whose device peak fits the budget and whose node's pinned host bytes
(predict.py host_per_node: offloaded block inputs, ZeRO-Offload, checkpoint staging) fit the host
budget is the choice: the offload's PCIe copies are modelled as hidden behind compute and nesting
costs an extra forward, so offload at k = 1 comes first where the host holds it, nesting (on the
device, or offloaded with ceil(L / k) inputs pinned) where it does not.

The offload's prefetch (train.offload_prefetch `auto`) is on wherever it fits: it hides the copies
back to the device behind compute, where fetching a block's saved tensors when its backward asks
for them exposes each copy (predict.py) but holds one block's on the device instead of two, so it
is the choice only when memory requires it.

The GQA attention path (train.attention_gqa `auto`) is weighed where it changes what runs: on
CUDA's flash route under GQA (bf16 / fp16; `search.gqa_paths`). SDPA's fused GQA call is faster
(the native path's measured slowdown, plan/efficiency.py GQA_NATIVE_SLOWDOWN, is in the predicted
step) but its backward holds dK/dV per query head (plan/reserved.py), so fused is the choice
wherever a candidate with it fits and native only when memory needs it. Elsewhere the path changes
nothing and `auto` writes fused without weighing it.

Under checkpointing the replay keeping all is the fastest (no forward runs a third time), so
checkpoint_replay_keeps `auto` resolves to all wherever it fits, else to attention, else to
nothing (layout.PLANNED_REPLAY_KEEPS: the dry run confirms the planner's model of each).

Head chunks (scheme ulysses, D > 1): a run of ulysses is planned as sp (layout.planned_scheme); c
chunks take `head_chunk_saving` off each candidate's predicted peak (the peers' model of ulysses
against upipe with c chunks, plan/peers.py). A candidate takes the fewest chunks whose peak fits
(1 when it fits whole: chunks replay each group's all-to-alls and attention in backward, so they
are never faster), the most when none does.

One ranking with tsp-plan: the candidates are `search.memory_variants` of the run's layout and
`search.ranking_key` orders them, so for the same scheme, D, batch split and budget tsp-plan's top
row is this choice. The ranking reads a hardware profile's rates (the GPU's own when it is a known
one, else RANKING_PROFILE); among variants of one layout only their ratios matter: more recompute
costs FLOPs, more head buckets cost collective latency. A ZeRO-3 run (sp, ulysses with zero.stage
auto) is planned with ZeRO-3's state (plan/state.py zero3_state_bytes, the model of the peers'
`sp_zero3` and `ulysses` layouts): tsp-plan's search ranks sp under ZeRO 0-2 and lists ZeRO-3's
sp and ulysses as those peer layouts.

The budget per process: train.memory_budget_gib when set; on a GPU its memory
(torch.cuda.mem_get_info's total) times the planner's usable share (Assumptions.hbm_usable, the rest
reserved for allocator slack, NCCL and the CUDA context); on CPU the host's MemAvailable
(/proc/meminfo, rounded down to whole GiB) shared by the job's processes (a CPU job runs on one
host). The host budget per node, for the offload: the host's MemAvailable on a GPU; on CPU (the
device is the host) what is left of it after the processes' device budgets. Two ranks may read
different figures (a shared node), so a job decides once: global rank 0 calls this through
plan/resolve.py and every rank runs its answer (run/startup.py).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Callable

from tsp_trainer.config import ModelConfig, TrainConfig
from tsp_trainer.config.schema import resolved_dtype, resolved_zero_stage
from tsp_trainer.config.validate import ulysses_head_chunk_counts
from tsp_trainer.plan.hardware import PROFILES, HardwareProfile
from tsp_trainer.plan.layout import (GQA_PATHS, NESTING_CANDIDATES, PLANNED_REPLAY_KEEPS, TSP_RECOMPUTE, Layout,
                                     planned_scheme)
from tsp_trainer.plan.precision import PRECISIONS
from tsp_trainer.plan.peers import head_chunk_saving
from tsp_trainer.plan.predict import Assumptions, Prediction, predict
from tsp_trainer.plan.search import gqa_paths, memory_variants, ranking_key

AUTO = "auto"
GIB = 2 ** 30
RANKING_PROFILE = "h100"        # rates for the ranking when the device is no known GPU (CPU runs)


class AutoSettingsError(ValueError):
    """No candidate of the `auto` settings fits the budget. Rank 0 decides for the job and
    broadcasts a refusal too (run/startup.py), so every rank raises it: the CLI prints it from
    rank 0 only (`agreed`)."""

    agreed = True


@dataclass(frozen=True)
class Budget:
    bytes: float                # per process
    source: str                 # where it came from, for the start-up line and the error
    host: float | None = None   # per node, for pinned host copies (None: not weighed)
    host_source: str = ""


@dataclass(frozen=True)
class MemoryChoice:
    """The values `auto` resolved to (explicit ones included as written) and the predicted peak
    of the run under them (the largest over data.seq_len_schedule's stages)."""

    tsp_recompute: str
    activation_checkpointing: bool
    head_buckets: int
    peak: float
    budget: Budget
    checkpoint_replay_keeps: str = "all"
    checkpoint_segment_blocks: int = 1
    ulysses_head_chunks: int | None = None      # scheme ulysses only
    offload_activations: bool = False
    offload_decided: bool = False               # train.offload_activations was auto (it is named)
    host_bytes: float = 0.0                     # predicted pinned host bytes per node
    offload_prefetch: bool = True               # named when the offload is on
    attention_gqa: str = "fused"                # train.attention_gqa as the run takes it
    gqa_decided: bool = False                   # train.attention_gqa was auto and weighed (it is named)

    def values(self) -> str:
        ac = str(self.activation_checkpointing).lower()
        chunks = "" if self.ulysses_head_chunks is None else f", ulysses_head_chunks={self.ulysses_head_chunks}"
        offload = f", offload_activations={str(self.offload_activations).lower()}" if self.offload_decided else ""
        if self.offload_activations:
            offload += f", offload_prefetch={str(self.offload_prefetch).lower()}"
        gqa = f", attention_gqa={self.attention_gqa}" if self.gqa_decided else ""
        return (f"tsp_recompute={self.tsp_recompute}, activation_checkpointing={ac}, "
                f"head_buckets={self.head_buckets}, "
                f"checkpoint_replay_keeps={self.checkpoint_replay_keeps}, "
                f"checkpoint_segment_blocks={self.checkpoint_segment_blocks}{chunks}{offload}{gqa}")

    def line(self) -> str:
        """The start-up line: `auto: tsp_recompute=..., ... (predicted peak X of Y budget: source)`,
        with the host bytes against the host budget when `auto` chose the offload."""
        host = ""
        if self.offload_decided and self.offload_activations and self.budget.host is not None:
            host = (f"; host {gib_text(self.host_bytes)} per node of {gib_text(self.budget.host)}: "
                    f"{self.budget.host_source}")
        return (f"auto: {self.values()} (predicted peak {gib_text(self.peak)} of "
                f"{gib_text(self.budget.bytes)} budget: {self.budget.source}{host})")

    def apply(self, cfg: TrainConfig) -> TrainConfig:
        """`cfg` with the keys set to this choice (what the run saves and logs)."""
        chunks = {} if self.ulysses_head_chunks is None else {"ulysses_head_chunks": self.ulysses_head_chunks}
        return dataclasses.replace(
            cfg, parallel=dataclasses.replace(cfg.parallel, tsp_recompute=self.tsp_recompute,
                                              head_buckets=self.head_buckets,
                                              checkpoint_replay_keeps=self.checkpoint_replay_keeps, **chunks),
            train=dataclasses.replace(cfg.train, activation_checkpointing=self.activation_checkpointing,
                                      checkpoint_segment_blocks=self.checkpoint_segment_blocks,
                                      offload_activations=self.offload_activations,
                                      offload_prefetch=self.offload_prefetch,
                                      attention_gqa=self.attention_gqa))

    def facts(self) -> dict:
        """The W&B run facts of the choice."""
        host = ({"host_bytes_per_node_gib": round(self.host_bytes / GIB, 3),
                 "host_budget_gib": round(self.budget.host / GIB, 3), "host_budget_source": self.budget.host_source}
                if self.offload_decided and self.budget.host is not None else {})
        return {"predicted_peak_gib": round(self.peak / GIB, 3),
                "memory_budget_gib": round(self.budget.bytes / GIB, 3),
                "memory_budget_source": self.budget.source, **host}


def gib_text(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / 2 ** 20:.1f} MiB"


def uses_auto(cfg: TrainConfig) -> bool:
    """Whether any key `auto` resolves is auto (checkpoint_replay_keeps only where checkpointing
    may be on: without it there is no replay, and plan/resolve.py writes all; offload_prefetch
    only where the offload may be on, else resolve.py writes true)."""
    replay = cfg.parallel.checkpoint_replay_keeps if cfg.train.activation_checkpointing is not False else None
    chunks = cfg.parallel.ulysses_head_chunks if _chunked_scheme(cfg) else None
    prefetch = cfg.train.offload_prefetch if cfg.train.offload_activations is not False else None
    return AUTO in (cfg.parallel.tsp_recompute, cfg.parallel.head_buckets, replay,
                    cfg.train.activation_checkpointing, cfg.train.checkpoint_segment_blocks, chunks,
                    cfg.train.offload_activations, prefetch)


def weighs_gqa(cfg: TrainConfig, *, cuda: bool) -> bool:
    """Whether train.attention_gqa is auto where the path changes what runs (module docstring)."""
    if cfg.train.attention_gqa != AUTO:
        return False
    prec = PRECISIONS[resolved_dtype(cfg.train.dtype, cuda)]
    return len(gqa_paths(cfg.model.to_model_config(), prec, "cuda" if cuda else "cpu")) > 1


def _chunked_scheme(cfg: TrainConfig) -> bool:
    """Whether parallel.ulysses_head_chunks acts: scheme ulysses over D > 1 ranks."""
    return cfg.parallel.scheme == "ulysses" and cfg.parallel.tsp_degree > 1


def head_chunk_candidates(cfg: TrainConfig) -> tuple[int, ...] | None:
    """The ulysses_head_chunks values `auto` weighs for `cfg` (fewest first), the explicit value
    alone, or None when the run is no chunked ulysses (the key then resolves to 1)."""
    if not _chunked_scheme(cfg):
        return None
    chunks = cfg.parallel.ulysses_head_chunks
    if chunks != AUTO:
        return (chunks,)
    return tuple(ulysses_head_chunk_counts(cfg.model.to_model_config(), cfg.parallel.tsp_degree))


def choose_auto_settings(cfg: TrainConfig, *, world_size: int, cuda: bool, device=None,
                         refuses: Callable[[TrainConfig], None] | None = None) -> MemoryChoice | None:
    """The `auto` settings of `cfg` resolved on this machine (None when none is auto): the budget
    of `memory_budget`, the GPU's profile for the ranking. refuses: raises ValueError for a
    candidate config this device cannot run (the Trainer passes its CUDA route rules)."""
    if not uses_auto(cfg) and not weighs_gqa(cfg, cuda=cuda):
        return None
    budget = memory_budget(cfg, world_size=world_size, cuda=cuda, device=device)
    return choose_memory_settings(cfg, world_size=world_size, budget=budget, cuda=cuda,
                                  hw=ranking_profile(cuda, device), refuses=refuses)


def choose_memory_settings(cfg: TrainConfig, *, world_size: int, budget: Budget, cuda: bool,
                           hw: HardwareProfile | None = None,
                           refuses: Callable[[TrainConfig], None] | None = None) -> MemoryChoice:
    """The fastest candidate of the run's auto keys whose predicted peak fits `budget`
    (`choose_among`); with train.offload_activations auto, the offload's and nesting's candidates
    only when none without them fits (module docstring)."""
    offload_auto = cfg.train.offload_activations == AUTO
    device_refuses = None if refuses is None else (
        lambda lay: refuses(_choice(lay, 0.0, budget, offload_auto=offload_auto).apply(cfg)))
    layouts = _candidates(cfg, world_size, cuda=cuda)
    plain, helped = layouts, []
    if offload_auto:
        nest_auto = cfg.train.checkpoint_segment_blocks == AUTO
        plain = [lay for lay in layouts
                 if not lay.offload_activations and (not nest_auto or lay.checkpoint_segment_blocks == 1)]
        helped = [lay for lay in layouts if lay not in plain]
    return choose_among(cfg.model.to_model_config(), plain, length_stages(cfg),
                        budget=budget, hw=hw, prec=PRECISIONS[resolved_dtype(cfg.train.dtype, cuda)],
                        cuda=cuda, refuses=device_refuses, head_chunks=head_chunk_candidates(cfg),
                        helped=helped, offload_auto=offload_auto, gqa_auto=weighs_gqa(cfg, cuda=cuda))


def choose_among(model: ModelConfig, layouts: list[Layout], stages: list[tuple[int, int]], *,
                 budget: Budget, hw: HardwareProfile | None, prec, cuda: bool,
                 refuses: Callable[[Layout], None] | None = None,
                 head_chunks: tuple[int, ...] | None = None,
                 helped: list[Layout] = (), offload_auto: bool = False, gqa_auto: bool = False) -> MemoryChoice:
    """The fastest of `layouts` (ranking_key) whose predicted peak at its worst stage ((seq_len,
    micro-batch) pairs) fits `budget`; AutoSettingsError naming the budget and the smallest
    predicted peak when none does. refuses: raises ValueError for a layout this device cannot run.
    head_chunks: the ulysses_head_chunks values to weigh, fewest first (None: not ulysses); each
    layout takes the fewest that fit (`_fewest_head_chunks`). helped: the layouts memory alone
    calls for (activation offload, nesting under offload `auto`), ranked with `layouts` only when
    none of these fits; an offloading one must also fit budget.host with its node's pinned bytes.
    offload_auto: the choice names the offload (train.offload_activations was auto); gqa_auto the
    GQA path (train.attention_gqa was auto and weighed)."""
    hw = hw or PROFILES[RANKING_PROFILE]
    ranked, refusal = _predicted(model, layouts, stages, budget, hw, prec, cuda, refuses, head_chunks)
    ranked.sort(key=lambda pc: ranking_key(pc[0], budget.bytes))
    if helped and (not ranked or ranked[0][0].memory["total"] > budget.bytes):
        more, refusal = _predicted(model, helped, stages, budget, hw, prec, cuda, refuses, head_chunks, refusal)
        ranked = sorted(ranked + more, key=lambda pc: (not _host_fits(pc[0], budget),
                                                       *ranking_key(pc[0], budget.bytes)))
    if not ranked:
        raise AutoSettingsError(f"auto settings: no candidate runs here ({refusal}); set "
                                "parallel.tsp_recompute, train.activation_checkpointing, "
                                "parallel.head_buckets, train.checkpoint_segment_blocks, "
                                "train.offload_activations, train.offload_prefetch and "
                                "parallel.checkpoint_replay_keeps explicitly")
    best, chunks = ranked[0]
    if best.memory["total"] > budget.bytes or not _host_fits(best, budget):
        raise _nothing_fits(ranked, budget, offload_auto)
    return _choice(best.layout, peak=best.memory["total"], budget=budget, chunks=chunks,
                   offload_auto=offload_auto, host=best.memory["host_per_node"], gqa_auto=gqa_auto)


def _predicted(model: ModelConfig, layouts: list[Layout], stages: list[tuple[int, int]], budget: Budget,
               hw: HardwareProfile, prec, cuda: bool, refuses: Callable[[Layout], None] | None,
               head_chunks: tuple[int, ...] | None, refusal: ValueError | None = None):
    """([(prediction at the worst stage, head chunks)] of the layouts this device runs, the first
    refusal)."""
    out = []
    for layout in layouts:
        try:
            if refuses is not None:
                refuses(layout)
            staged = _stage_predictions(model, layout, stages, hw, prec, cuda)
        except ValueError as err:          # the device's kernel rules refuse this mode
            refusal = refusal or err
            continue
        out.append(_fewest_head_chunks(model, staged, head_chunks, budget.bytes, prec))
    return out, refusal


def _host_fits(p: Prediction, budget: Budget) -> bool:
    """Whether an offloading layout's pinned host bytes per node fit the host budget (a layout
    without activation offload pins no block input and is not weighed against it)."""
    return (not p.layout.offload_activations or budget.host is None
            or p.memory["host_per_node"] <= budget.host)


def _nothing_fits(ranked: list[tuple[Prediction, int | None]], budget: Budget,
                  offload_auto: bool) -> AutoSettingsError:
    """The one-line refusal: the smallest predicted device peak, or, when offloading layouts fit
    the device but not the host, the smallest host bytes they pin."""
    on_device = [pc for pc in ranked if pc[0].memory["total"] <= budget.bytes]
    if on_device and budget.host is not None:
        least, chunks = min(on_device, key=lambda pc: pc[0].memory["host_per_node"])
        return AutoSettingsError(
            f"auto settings: nothing fits the host budget of {gib_text(budget.host)} per node "
            f"({budget.host_source}) with the device budget of {gib_text(budget.bytes)} per process "
            f"({budget.source}): the offload pinning the least needs {gib_text(least.memory['host_per_node'])} "
            f"({_choice(least.layout, 0.0, budget, chunks, offload_auto=offload_auto).values()}); use more "
            "ranks (parallel.tsp_degree), a shorter data.seq_len, or nodes with more host memory")
    smallest, least_chunks = min(ranked, key=lambda pc: pc[0].memory["total"])
    return AutoSettingsError(
        f"auto settings: nothing fits the memory budget of {gib_text(budget.bytes)} per process "
        f"({budget.source}): the smallest predicted peak is {gib_text(smallest.memory['total'])} "
        f"({_choice(smallest.layout, 0.0, budget, least_chunks, offload_auto=offload_auto).values()}); "
        "use more model-parallel ranks "
        "(parallel.tsp_degree), a shorter data.seq_len, a smaller data.micro_batch_size, or a "
        "larger train.memory_budget_gib if the device has it")


def run_layout(cfg: TrainConfig, world_size: int) -> Layout:
    """The planner's Layout of a run of `cfg` on `world_size` processes (recompute, checkpointing
    and buckets at Layout's defaults, offload off when auto: memory_variants varies them; the loss
    and MLP chunks as the run sets them). A ZeRO-3 run (sp, ulysses) is planned with its state
    sharded over all ranks and the layers' weights gathered for use (plan/state.py
    zero3_state_bytes, the peers' model). ZeRO-Offload's CPU Adam is planned under ZeRO 1-2, its
    state on the host; under ZeRO-3 the plan keeps the optimizer on the device, an upper bound.
    train.attention_gqa as set, fused when auto (memory_variants weighs both where they differ)."""
    p, stage = cfg.parallel, resolved_zero_stage(cfg.zero.stage, cfg.parallel.scheme)
    return Layout(planned_scheme(p.scheme), p.tsp_degree, dp=world_size // p.tsp_degree, tp=p.tp_degree,
                  sp=p.sp_degree, zero_stage=stage,
                  micro_batch=cfg.data.micro_batch_size,
                  grad_accum=cfg.train.grad_accum, offload_activations=cfg.train.offload_activations is True,
                  offload_prefetch=cfg.train.offload_prefetch is not False,
                  offload_optimizer=cfg.zero.offload_optimizer == "cpu" and stage in (1, 2),
                  loss_chunk_tokens=p.loss_chunk_tokens, mlp_chunk_tokens=p.mlp_chunk_tokens,
                  attention_chunk_tokens=p.attention_chunk_tokens,
                  attention_gqa="fused" if cfg.train.attention_gqa == AUTO else cfg.train.attention_gqa)


def _candidates(cfg: TrainConfig, world_size: int, *, cuda: bool = False) -> list[Layout]:
    """The run's layout under every value of the auto keys (the explicit ones fixed)."""
    p, ac = cfg.parallel, cfg.train.activation_checkpointing
    keeps, k = p.checkpoint_replay_keeps, cfg.train.checkpoint_segment_blocks
    offload, prefetch = cfg.train.offload_activations, cfg.train.offload_prefetch
    model = cfg.model.to_model_config()
    return memory_variants(model, run_layout(cfg, world_size),
                           recompute=TSP_RECOMPUTE if p.tsp_recompute == AUTO else (p.tsp_recompute,),
                           checkpointing=(ac,) if ac != AUTO else (True,) if k not in (AUTO, 1) else (False, True),
                           buckets=None if p.head_buckets == AUTO else (p.head_buckets,),
                           replay=PLANNED_REPLAY_KEEPS if keeps == AUTO else (keeps,),
                           offload=(False, True) if offload == AUTO else (offload,),
                           prefetch=(True, False) if prefetch == AUTO else (prefetch,),
                           segments=(tuple(n for n in NESTING_CANDIDATES if n <= max(1, model.num_layers))
                                     if k == AUTO else (k,)),
                           gqa=GQA_PATHS if weighs_gqa(cfg, cuda=cuda) else None)


def length_stages(cfg: TrainConfig) -> list[tuple[int, int]]:
    """(seq_len, micro-batch) of every stage of data.seq_len_schedule, or of the whole run."""
    d = cfg.data
    return ([(s.seq_len, s.micro_batch_size or d.micro_batch_size) for s in d.seq_len_schedule]
            or [(d.seq_len, d.micro_batch_size)])


def _stage_predictions(model: ModelConfig, layout: Layout, stages: list[tuple[int, int]],
                       hw: HardwareProfile, prec, cuda: bool) -> list[tuple[int, Prediction]]:
    """(seq_len, prediction of `layout` at that stage) for every stage."""
    preds = []
    for seq_len, micro in stages:
        stage = dataclasses.replace(layout, micro_batch=micro)
        preds.append((seq_len, predict(model.replace(max_seq_len=max(seq_len, model.max_seq_len)), stage,
                                       seq_len, hw, prec=prec, device="cuda" if cuda else "cpu")))
    return preds


def _fewest_head_chunks(model: ModelConfig, staged: list[tuple[int, Prediction]],
                        counts: tuple[int, ...] | None, capacity: float, prec) -> tuple[Prediction, int | None]:
    """(the prediction at the stage with the largest predicted peak, the head chunks): without
    `counts` (no ulysses) the stage's own peak; else the fewest counts whose peak, less
    `head_chunk_saving`, fits `capacity` at every stage (the most when none does), the prediction's
    total lowered by that saving."""
    def worst(chunks: int | None) -> Prediction:
        adjusted = []
        for seq_len, p in staged:
            saving = 0 if chunks is None else head_chunk_saving(model, p.layout, seq_len, chunks, prec)
            adjusted.append(p if not saving else dataclasses.replace(
                p, memory={**p.memory, "total": p.memory["total"] - saving, "head_chunk_saving": saving}))
        return max(adjusted, key=lambda p: p.memory["total"])

    if counts is None:
        return worst(None), None
    for chunks in counts[:-1]:
        pred = worst(chunks)
        if pred.memory["total"] <= capacity:
            return pred, chunks
    return worst(counts[-1]), counts[-1]


def _choice(layout: Layout, peak: float, budget: Budget, chunks: int | None = None, *,
            offload_auto: bool = False, host: float = 0.0, gqa_auto: bool = False) -> MemoryChoice:
    return MemoryChoice(layout.tsp_recompute, layout.activation_checkpointing, layout.head_buckets,
                        peak=peak, budget=budget, checkpoint_replay_keeps=layout.replay_keeps,
                        checkpoint_segment_blocks=layout.checkpoint_segment_blocks,
                        ulysses_head_chunks=chunks, offload_activations=layout.offload_activations,
                        offload_decided=offload_auto, host_bytes=host, attention_gqa=layout.attention_gqa,
                        gqa_decided=gqa_auto, offload_prefetch=layout.offload_prefetch)


def memory_budget(cfg: TrainConfig, *, world_size: int, cuda: bool, device=None) -> Budget:
    """This process's budget, and its node's host budget when the offload is auto (module
    docstring)."""
    if cfg.train.memory_budget_gib is not None:
        budget = Budget(cfg.train.memory_budget_gib * GIB, "train.memory_budget_gib")
    else:
        budget = device_budget(world_size=world_size, cuda=cuda, device=device)
    if cfg.train.offload_activations != AUTO:
        return budget
    return dataclasses.replace(budget, **host_budget(budget, world_size=world_size, cuda=cuda))


def host_budget(budget: Budget, *, world_size: int, cuda: bool) -> dict:
    """{host, host_source}: the host memory a node's pinned copies may take. On a GPU the host's
    MemAvailable (whole GiB); on CPU the device is the host, so what is left of MemAvailable once
    the job's processes (one host) hold their device budgets."""
    available = host_available_bytes() // GIB * GIB
    if cuda:
        return {"host": float(available), "host_source": f"host MemAvailable {gib_text(available)}"}
    left = max(0.0, available - world_size * budget.bytes)
    return {"host": left, "host_source": f"host MemAvailable {gib_text(available)} less {world_size} "
                                         f"x {gib_text(budget.bytes)} device budgets"}


def device_budget(*, world_size: int, cuda: bool, device=None) -> Budget:
    """The device's usable memory per process: a GPU's, or the host's shared by the processes."""
    if cuda:
        import torch

        _, total = torch.cuda.mem_get_info(device)
        usable = Assumptions().hbm_usable
        return Budget(total * usable, f"GPU memory {gib_text(total)} x {usable:g} usable")
    available = host_available_bytes() // GIB * GIB
    return Budget(available / world_size,
                  f"host MemAvailable {gib_text(available)} / {world_size} processes")


def host_available_bytes() -> int:
    """MemAvailable of /proc/meminfo (Linux), else the free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def ranking_profile(cuda: bool, device=None) -> HardwareProfile:
    """The profile whose rates rank the candidates: the GPU's own when its name matches one."""
    if cuda:
        import torch

        name = torch.cuda.get_device_name(device).lower()
        matches = [key for key in PROFILES if key in name]
        if matches:
            return PROFILES[max(matches, key=len)]
    return PROFILES[RANKING_PROFILE]


def choose_bench_settings(model: ModelConfig, *, degree: int, seq_len: int, micro_batch: int,
                          head_buckets: int, activation_checkpointing: bool, dtype: str,
                          cuda: bool) -> MemoryChoice:
    """tsp-bench's `--tsp-recompute auto`: `choose_among` the recompute modes of one TSP group of
    `degree` processes (dp 1) with the bench's buckets and checkpointing as given, against this
    device's budget."""
    base = Layout("tsp", degree, dp=1, zero_stage=0 if dtype == "fp32" else 1, micro_batch=micro_batch,
                  grad_accum=1)
    layouts = memory_variants(model, base, recompute=TSP_RECOMPUTE, checkpointing=(activation_checkpointing,),
                              buckets=(head_buckets,))
    return choose_among(model, layouts, [(seq_len, micro_batch)],
                        budget=device_budget(world_size=degree, cuda=cuda), hw=ranking_profile(cuda),
                        prec=PRECISIONS[dtype], cuda=cuda)


__all__ = ["AUTO", "AutoSettingsError", "Budget", "MemoryChoice", "choose_among", "choose_auto_settings",
           "choose_bench_settings", "choose_memory_settings", "device_budget", "host_budget", "memory_budget",
           "uses_auto", "weighs_gqa"]
