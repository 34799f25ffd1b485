"""Enumerate the layouts of a job (scheme, D, DP, ZeRO stage, activation checkpointing, TSP
recompute mode, head buckets, micro-batch, grad accumulation, GQA attention path), predict each one, keep those that
fit in memory and rank them by predicted step time (`ranking_key`, which the trainer's `auto`
settings share: plan/auto.py)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import product

from tsp_trainer.config import ModelConfig
from tsp_trainer.config.validate import check_parallel_shapes
from tsp_trainer.plan.layout import NESTING_CANDIDATES, PLANNED_REPLAY_KEEPS, SCHEMES, TSP_RECOMPUTE, Layout
from tsp_trainer.plan.precision import BF16, Precision
from tsp_trainer.plan.predict import Assumptions, Prediction, predict
from tsp_trainer.plan.hardware import HardwareProfile
from tsp_trainer.plan.transients import native_gqa


class PlanError(ValueError):
    """A request no layout can serve (the CLI prints it and exits with code 2)."""


@dataclass
class PlanResult:
    candidates: list[Prediction]            # every valid layout, ranked (fitting ones first)
    fitting: list[Prediction]
    rejected: dict[str, str] = field(default_factory=dict)   # "scheme D=..": why it was skipped

    def best_per_scheme(self) -> dict[str, Prediction]:
        """Per scheme (tp_x_sp per T x S): the fastest layout that fits, or, when none fits, the
        one that needs the least memory."""
        out: dict[str, Prediction] = {}
        for p in self.candidates:
            name = _family(p.layout)
            if name not in out or _best_key(p) < _best_key(out[name]):
                out[name] = p
        return out


def _family(layout: Layout) -> str:
    if layout.scheme != "tp_x_sp":
        return layout.scheme
    return f"tp{layout.tp}xsp{layout.sp}" + ("+seqpar" if layout.tp_sequence_parallel else "")


def _best_key(p: Prediction):
    return (0, -p.tokens_per_s, p.memory["total"]) if p.fits else (1, p.memory["total"], 0)


def _key(p: Prediction):
    """tsp-plan's ranking: layouts that fit (HBM and host memory) first, then `ranking_key`
    against the profile's usable HBM."""
    return (not p.fits, *ranking_key(p, p.capacity))


def ranking_key(p: Prediction, capacity: float):
    """The one ranking of tsp-plan and of the trainer's `auto` settings (plan/auto.py): layouts
    whose predicted peak (model state + activation peak) fits `capacity` bytes first, then the
    shorter predicted step, then less compute (a step the model predicts bound by overlapped
    communication ties across recompute modes; where compute and transfers share the cores, as on
    CPU, the mode that recomputes least is the fastest), then no activation offload (its copies
    hidden behind compute tie with keeping the activations, and they still take PCIe and host
    memory), then the offload's prefetch, then less nesting (checkpoint_segment_blocks), then less
    memory. The GQA-native path's measured slowdown (predict.gqa_native_slowdown) puts SDPA's fused
    GQA first wherever both fit."""
    return (p.memory["total"] > capacity, p.step_time, p.times["compute_per_micro"],
            p.layout.offload_activations, not p.layout.offload_prefetch,
            p.layout.checkpoint_segment_blocks, p.memory["total"])


def gqa_paths(cfg: ModelConfig, prec: Precision, device: str = "cuda") -> tuple[str, ...]:
    """The train.attention_gqa values worth weighing for `cfg` in `prec` on `device`: fused and
    native where the GQA-native path exists (CUDA's flash route under GQA), else native alone (the
    Layout's default: there the path changes nothing)."""
    exists = native_gqa(prec.act, device, cfg.num_heads != cfg.num_kv_heads, cfg.head_dim)
    return ("fused", "native") if exists else ("native",)


def memory_variants(cfg: ModelConfig, base: Layout, *, recompute=TSP_RECOMPUTE,
                    checkpointing=(False, True), buckets: tuple[int, ...] | None = None,
                    offload: tuple[bool, ...] | None = None,
                    replay: tuple[str, ...] = PLANNED_REPLAY_KEEPS,
                    segments: tuple[int, ...] = (1,), gqa: tuple[str, ...] | None = None,
                    prefetch: tuple[bool, ...] = (True, False)) -> list[Layout]:
    """`base` under every TSP recompute mode, activation checkpointing and head-bucket count it
    takes (the settings `auto` chooses among; TSP only recomputes by shard and splits heads in
    buckets, so the baselines vary checkpointing alone), under each of `replay` (what TSP's
    checkpoint replay keeps, varied under checkpointing only: without it the setting changes
    nothing, and the first of `replay` stands), and under each of `offload` (activation offload
    off / on; None: base's own). A combination the trainer refuses (Layout's rules: no selective
    or none recompute with checkpointing or offload) is left out. buckets=None: every divisor of
    the K/V heads per weight shard. segments: the checkpoint_segment_blocks values taken under
    checkpointing (nested checkpointing; 1 without it). gqa: the attention_gqa values (None:
    base's own; `gqa_paths`). prefetch: the offload_prefetch values taken under activation offload
    (True without it: nothing to fetch)."""
    tsp = base.scheme == "tsp"
    modes = recompute if tsp else ("full",)
    counts = (buckets or _buckets(cfg, base.degree)) if tsp else (1,)
    offloads = (base.offload_activations,) if offload is None else offload
    out = []
    for nb in counts:
        for mode in modes:
            for ac in checkpointing:
                for keeps in (replay if tsp and ac else replay[:1]):
                    for off in offloads:
                        for k, ahead in product(segments if ac else (1,), prefetch if off else (True,)):
                            for path in (gqa or (base.attention_gqa,)):
                                try:
                                    out.append(replace(base, tsp_recompute=mode, activation_checkpointing=ac,
                                                       head_buckets=nb, offload_activations=off,
                                                       replay_keeps=keeps, checkpoint_segment_blocks=k,
                                                       offload_prefetch=ahead, attention_gqa=path))
                                except ValueError:              # refused by the trainer
                                    continue
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(cfg: ModelConfig, *, seq_len: int, global_batch: int, world: int,
                      schemes=SCHEMES, max_degree: int = 64, zero_stages=(0, 1, 2),
                      micro_batches: tuple[int, ...] | None = None,
                      rejected: dict[str, str] | None = None,
                      tsp_recompute: tuple[str, ...] = TSP_RECOMPUTE,
                      offload_optimizer: bool = False,
                      offload_activations: tuple[bool, ...] = (False, True),
                      fields: dict | None = None,
                      replay_keeps: tuple[str, ...] = PLANNED_REPLAY_KEEPS,
                      segments: tuple[int, ...] = (1,), gqa: tuple[str, ...] | None = None) -> list[Layout]:
    """Every layout of `world` GPUs whose shapes split (config/validate.py's rules) and whose DP
    degree divides the global batch (in sequences), under each of `tsp_recompute` (TSP),
    activation checkpointing, head-bucket count and activation offload (`offload_activations`)
    the trainer takes (`memory_variants`), and under checkpointing each of `replay_keeps` (TSP's
    checkpoint_replay_keeps). `offload_optimizer`: every layout offloads (ZeRO 1 and 2 only, as
    the trainer requires). `fields`: Layout fields set on every layout (chunk settings,
    tiled_accumulators). segments: the checkpoint_segment_blocks values of checkpointed layouts.
    gqa: the attention_gqa values of every layout (None: native alone; `gqa_paths`)."""
    rejected = rejected if rejected is not None else {}
    if offload_optimizer:
        zero_stages = tuple(z for z in zero_stages if z >= 1)
    out: list[Layout] = []
    for scheme in schemes:
        for d in _divisors(world):
            if d > max_degree or (d == 1 and scheme != "tsp"):
                continue                                   # D = 1 is listed once, as plain DP
            dp = world // d
            if global_batch % dp:
                rejected[f"{scheme} D={d}"] = (f"DP={dp} does not divide the global batch of "
                                               f"{global_batch} sequences")
                continue
            for axes in _axes(scheme, d):
                try:
                    check_parallel_shapes(cfg, scheme=scheme, degree=d, seq_len=seq_len, **axes)
                except ValueError as err:
                    rejected[f"{scheme} D={d} {axes or ''}".strip()] = str(err)
                    continue
                per_replica = global_batch // dp
                mbs = [m for m in _divisors(per_replica) if micro_batches is None or m in micro_batches]
                for extra in _layout_axes(scheme, axes):
                    for mb in mbs:
                        for zero in (zero_stages if dp > 1 else zero_stages[:1]):
                            base = Layout(scheme, d, dp=dp, zero_stage=zero, micro_batch=mb,
                                          grad_accum=per_replica // mb,
                                          offload_optimizer=offload_optimizer,
                                          **extra, **(fields or {}))
                            out += memory_variants(cfg, base, recompute=tsp_recompute,
                                                   offload=offload_activations, replay=replay_keeps,
                                                   segments=segments, gqa=gqa)
    return out


def _axes(scheme: str, d: int) -> list[dict]:
    if scheme != "tp_x_sp":
        return [{}]
    return [{"tp_degree": t, "sp_degree": d // t} for t in _divisors(d) if 1 < t < d]


def _layout_axes(scheme: str, axes: dict) -> list[dict]:
    """tp_x_sp comes with and without Megatron SP inside its tp sub-axis."""
    if scheme != "tp_x_sp":
        return [{}]
    return [{"tp": axes["tp_degree"], "sp": axes["sp_degree"], "tp_sequence_parallel": seqpar}
            for seqpar in (False, True)]


def _buckets(cfg: ModelConfig, d: int) -> list[int]:
    per_shard = cfg.num_kv_heads // d
    return _divisors(per_shard) if per_shard else [1]


def plan(cfg: ModelConfig, *, seq_len: int, global_batch: int, hw: HardwareProfile, nodes: int,
         schemes=SCHEMES, prec: Precision = BF16, assumptions: Assumptions = Assumptions(),
         max_degree: int = 64, micro_batches: tuple[int, ...] | None = None,
         tsp_recompute: tuple[str, ...] = TSP_RECOMPUTE, offload_optimizer: bool = False,
         offload_activations: tuple[bool, ...] = (False, True)) -> PlanResult:
    """Predict every candidate layout; raise PlanError when none exists or none fits (in HBM or
    in the node's host memory). tsp_recompute: the TSP recompute modes to rank (default all, as
    `auto` does); offload_activations: with and without activation offload (default both).
    Nested checkpointing (checkpoint_segment_blocks > 1, an extra forward per segment) is weighed
    only when no layout fits without it, as `auto` does."""
    world = nodes * hw.gpus_per_node
    if global_batch < 1:
        raise PlanError(f"--global-batch={global_batch} must be >= 1 (sequences per optimizer step)")
    result = None
    for segments in ((1,), NESTING_CANDIDATES):
        result = _plan_with(cfg, seq_len=seq_len, global_batch=global_batch, hw=hw, world=world,
                            nodes=nodes, schemes=schemes, prec=prec, assumptions=assumptions,
                            max_degree=max_degree, micro_batches=micro_batches,
                            tsp_recompute=tsp_recompute, offload_optimizer=offload_optimizer,
                            offload_activations=offload_activations, segments=segments)
        if result.fitting:
            return result
    raise _nothing_fits(result.candidates, hw, assumptions)


def _plan_with(cfg: ModelConfig, *, seq_len: int, global_batch: int, hw: HardwareProfile, world: int,
               nodes: int, schemes, prec: Precision, assumptions: Assumptions, max_degree: int,
               micro_batches, tsp_recompute, offload_optimizer: bool, offload_activations,
               segments: tuple[int, ...]) -> PlanResult:
    """`plan` with checkpointed layouts under each of `segments`; the result, fitting or not."""
    rejected: dict[str, str] = {}
    layouts = candidate_layouts(cfg, seq_len=seq_len, global_batch=global_batch, world=world,
                                schemes=schemes, max_degree=max_degree, micro_batches=micro_batches,
                                zero_stages=prec.zero_stages, rejected=rejected,
                                tsp_recompute=tsp_recompute, offload_optimizer=offload_optimizer,
                                offload_activations=offload_activations, gqa=gqa_paths(cfg, prec),
                                segments=segments)
    if not layouts:
        dps = sorted({world // d for d in _divisors(world) if d <= max_degree})
        raise PlanError(
            f"no layout of {world} GPUs ({nodes} nodes x {hw.gpus_per_node}) can take --global-batch="
            f"{global_batch} sequences: the batch must be a multiple of the data-parallel degree "
            f"DP = GPUs / D of some valid layout (possible DP: {', '.join(map(str, dps))}; D is "
            f"limited by the model's heads, KV heads, intermediate size and vocabulary, and by "
            f"--seq-len={seq_len}); use e.g. --global-batch={_suggest(global_batch, dps)}")
    preds = []
    for lay in layouts:
        try:
            preds.append(predict(cfg, lay, seq_len, hw, global_batch=global_batch, prec=prec,
                                 assumptions=assumptions))
        except ValueError as err:              # a recompute mode the CUDA kernel rules refuse
            rejected[lay.label()] = str(err)
    preds.sort(key=_key)
    return PlanResult(candidates=preds, fitting=[p for p in preds if p.fits], rejected=rejected)


def _nothing_fits(preds: list[Prediction], hw: HardwareProfile, assumptions: Assumptions) -> PlanError:
    """Why no layout fits, in one line: host memory when some layout fits in HBM (the one pinning
    the least is named), else HBM (the layout needing the least is named)."""
    in_hbm = [p for p in preds if "HBM" not in p.exceeds]
    if in_hbm:
        best = min(in_hbm, key=lambda p: p.memory["host_per_node"])
        what = "the layouts that fit in HBM pin too much host memory; the smallest"
        need = (f"{best.memory['host_per_node'] / 1e9:,.0f} GB per node, more than the "
                f"{best.host_capacity / 1e9:,.0f} GB of a {hw.name} node (--host-memory-gb)")
        fix = "use more GPUs, a shorter --seq-len or a node with more memory"
    else:
        best = min(preds, key=lambda p: p.memory["total"])
        what = "the smallest layout"
        need = (f"{best.memory['total'] / 1e9:.1f} GB per GPU, more than the {best.capacity / 1e9:.1f} GB "
                f"usable on a {hw.name} ({hw.hbm_bytes / 1e9:.0f} GB HBM x {assumptions.hbm_usable:.2f})")
        fix = "use more GPUs, a shorter --seq-len, a larger GPU, or a smaller model"
    return PlanError(f"nothing fits: {what}, {best.layout.label()}, needs {need}; {fix}")


def _suggest(global_batch: int, dps: list[int]) -> int:
    """The smallest multiple of a possible DP degree that is >= the requested batch."""
    return min(((global_batch + dp - 1) // dp) * dp for dp in dps)
