"""The longest sequence each scheme can train on a cluster (`tsp-plan --max-seq-len`).

For one scheme, a sequence length S "fits" when some layout of that scheme (any D, DP, ZeRO stage,
activation checkpointing, head buckets, micro-batch; plan/search.py's candidates, with the loss and
MLP chunks `auto` resolves) fits in GPU memory and its node's pinned host bytes fit the node's host
memory, under the planner's memory model (plan/predict.py). Memory grows with S for every layout,
so the longest S is found by doubling until nothing fits, then bisecting, on multiples of
`granule` tokens (1,024 by default: a multiple of 2D for every D the search tries). The answer
says which limit stopped it: HBM, or host memory (some layout one granule longer fits in HBM but
not in the host).
"""

from __future__ import annotations

from dataclasses import dataclass

from tsp_trainer.config import ModelConfig
from tsp_trainer.config.model import FP32_EXACT_POSITIONS
from tsp_trainer.plan.layout import NESTING_CANDIDATES, PLANNED_REPLAY_KEEPS
from tsp_trainer.plan.precision import BF16, Precision
from tsp_trainer.plan.predict import Assumptions, Prediction, predict
from tsp_trainer.plan.hardware import HardwareProfile
from tsp_trainer.plan.search import candidate_layouts, gqa_paths

LIMIT_TOKENS = 1 << 27          # 134M tokens: the search stops here
# the trainer's longest sequence: RoPE's fp32 angles take exact positions below 2^24 only
# (model/rope.py check_fp32_positions), so a TSP answer stops at 16,777,216 tokens
TRAINER_LIMIT = FP32_EXACT_POSITIONS


@dataclass
class Longest:
    scheme: str
    seq_len: int                         # 0: not even one granule fits
    best: Prediction | None              # the fitting layout with the least memory at seq_len
    refused: str = ""                    # why no layout was tried (a pair the trainer refuses)
    bound: str = ""                      # what one granule more overflows: "HBM", "host", "search
                                         # limit", "RoPE positions" (the trainer's longest)

    def as_dict(self) -> dict:
        out = {"scheme": self.scheme, "max_seq_len": self.seq_len, "bound_by": self.bound}
        if self.refused:
            out["refused"] = self.refused
        if self.best is not None:
            out.update(layout=self.best.layout.label(), memory=self.best.memory,
                       step_time_s=self.best.step_time, tokens_per_s=self.best.tokens_per_s,
                       mfu=self.best.mfu, peak_breakdown=peak_breakdown(self.best))
        return out


def _predictions(cfg: ModelConfig, scheme: str, seq_len: int, *, hw: HardwareProfile, world: int,
                 global_batch: int, prec: Precision, assumptions: Assumptions, max_degree: int,
                 offload: bool, tsp_recompute: str, offload_optimizer: bool,
                 fields: dict | None, replay_keeps: tuple[str, ...] = PLANNED_REPLAY_KEEPS,
                 segments: tuple[int, ...] = NESTING_CANDIDATES) -> list[Prediction]:
    """Every candidate layout of `scheme` at seq_len, predicted (offload: all of them offload
    their activations, none otherwise; checkpointed ones under each of `segments`, nested
    checkpointing's checkpoint_segment_blocks)."""
    model = cfg.replace(max_seq_len=max(cfg.max_seq_len, seq_len))
    layouts = candidate_layouts(model, seq_len=seq_len, global_batch=global_batch, world=world,
                                schemes=(scheme,), max_degree=max_degree, zero_stages=prec.zero_stages,
                                micro_batches=(1,), tsp_recompute=(tsp_recompute,),
                                offload_optimizer=offload_optimizer, offload_activations=(offload,),
                                fields=fields, replay_keeps=replay_keeps, segments=segments,
                                gqa=gqa_paths(model, prec))
    return [predict(model, lay, seq_len, hw, global_batch=global_batch, prec=prec,
                    assumptions=assumptions) for lay in layouts]


def _least_memory(preds: list[Prediction]) -> Prediction | None:
    """The fitting prediction with the least GPU memory, if any fits; among equal peaks the one
    with the least nesting (checkpoint_segment_blocks) and host memory."""
    fitting = [p for p in preds if p.fits]
    return min(fitting, key=_memory_key) if fitting else None


def _memory_key(p: Prediction) -> tuple:
    """GPU peak, then nesting (a peer's layout has none), then host memory."""
    return (p.memory["total"], getattr(p.layout, "checkpoint_segment_blocks", 1), p.memory["host_per_node"])


def _fitting(cfg: ModelConfig, scheme: str, seq_len: int, *, hw: HardwareProfile, world: int,
             global_batch: int, prec: Precision, assumptions: Assumptions, max_degree: int,
             offload: bool, tsp_recompute: str = "full",
             offload_optimizer: bool = False, fields: dict | None = None,
             replay_keeps: tuple[str, ...] = PLANNED_REPLAY_KEEPS,
             segments: tuple[int, ...] = NESTING_CANDIDATES) -> Prediction | None:
    """The layout of `scheme` with the least GPU memory at seq_len, if one fits (HBM and host)."""
    return _least_memory(_predictions(cfg, scheme, seq_len, hw=hw, world=world, global_batch=global_batch,
                                      prec=prec, assumptions=assumptions, max_degree=max_degree,
                                      offload=offload, tsp_recompute=tsp_recompute,
                                      offload_optimizer=offload_optimizer, fields=fields,
                                      replay_keeps=replay_keeps, segments=segments))


def _bound(preds: list[Prediction]) -> str:
    """Which limit a length nothing fits at is over: host memory when some layout fits in HBM
    (its node pins too much), HBM otherwise."""
    return "host" if any("HBM" not in p.exceeds for p in preds) else "HBM"


def longest_seq_len(cfg: ModelConfig, scheme: str, *, hw: HardwareProfile, nodes: int,
                    global_batch: int = 1, prec: Precision = BF16,
                    assumptions: Assumptions = Assumptions(), max_degree: int = 64,
                    offload: bool = False, granule: int = 1024, tsp_recompute: str = "full",
                    offload_optimizer: bool = False, fields: dict | None = None,
                    replay_keeps: tuple[str, ...] = PLANNED_REPLAY_KEEPS,
                    segments: tuple[int, ...] = NESTING_CANDIDATES) -> Longest:
    """Largest multiple of `granule` tokens that some layout of `scheme` fits (doubling, then
    bisection); TSP layouts with `tsp_recompute` (selective or none: nothing with activation
    offload, the trainer refuses the pair); `offload`: every layout offloads its activations
    (with or without activation checkpointing); `offload_optimizer`: AdamW's state in host memory
    (ZeRO-Offload) in every layout; `fields`: Layout fields set on every layout (the ablation's
    switches: loss_chunk_tokens, mlp_chunk_tokens, tiled_accumulators); `replay_keeps`: the
    values of TSP's checkpoint_replay_keeps its checkpointed layouts take (default all only: layout.PLANNED_REPLAY_KEEPS);
    `segments`: the checkpoint_segment_blocks values they take (nested checkpointing; default
    layout.NESTING_CANDIDATES, (1,) for per-block checkpointing only)."""
    world = nodes * hw.gpus_per_node
    if offload and scheme == "tsp" and tsp_recompute != "full":
        return Longest(scheme, 0, None, refused=f"tsp_recompute={tsp_recompute} is refused with "
                                                "activation offload (--tsp-recompute full)")

    def predictions(seq_len: int) -> list[Prediction]:
        return _predictions(cfg, scheme, seq_len, hw=hw, world=world, global_batch=global_batch,
                            prec=prec, assumptions=assumptions, max_degree=max_degree, offload=offload,
                            tsp_recompute=tsp_recompute, offload_optimizer=offload_optimizer,
                            fields=fields, replay_keeps=replay_keeps, segments=segments)

    seq_len, best, bound = search_longest(predictions, granule, limit=TRAINER_LIMIT, limit_name="RoPE positions")
    return Longest(scheme, seq_len, best, bound=bound)


def search_longest(predictions, granule: int, limit: int = LIMIT_TOKENS,
                   limit_name: str = "search limit") -> tuple[int, Prediction | None, str]:
    """(longest fitting multiple of `granule`, its least-memory prediction, what one granule more
    overflows) for `predictions(seq_len)`, the candidate layouts predicted at a length: doubling
    until nothing fits, then bisection (memory grows with the length for every layout); at most
    `limit` tokens, named `limit_name` when that stops it."""
    def fit(units: int) -> tuple[Prediction | None, list[Prediction]]:
        preds = predictions(units * granule)
        return _least_memory(preds), preds

    top = limit // granule
    lo, lo_pred = 0, None                      # lo units fit (0: trivially)
    hi, hi_preds = 1, []
    while hi <= top:
        p, hi_preds = fit(hi)
        if p is None:
            break
        lo, lo_pred = hi, p
        if hi == top:
            return lo * granule, lo_pred, limit_name
        hi = min(hi * 2, top)
    else:
        return lo * granule, lo_pred, limit_name
    while hi - lo > 1:                         # invariant: lo fits, hi does not
        mid = (lo + hi) // 2
        p, preds = fit(mid)
        if p is None:
            hi, hi_preds = mid, preds
        else:
            lo, lo_pred = mid, p
    return lo * granule, lo_pred, _bound(hi_preds)


def peak_breakdown(p: Prediction) -> dict[str, int]:
    """What one GPU's peak is made of (bytes): model state, the activations of the peak phase
    (what the layers keep on the GPU at that moment, and the phase's transients on top), the
    libraries' reserve. The pieces sum to memory["total"]."""
    m, a = p.memory, p.activation
    kept = _kept_on_gpu(p)
    return {"params": m["params"], "grads": m["grads"], "optimizer": m["optimizer"],
            "activations_kept": kept, "activations_transient": m["activations_peak"] - kept,
            "reserved": m["reserved"], "total": m["total"], "peak_phase": a.peak_phase}


def _kept_on_gpu(p: Prediction) -> int:
    """Saved activations on the GPU in the peak phase, at most the phase's bytes: the layers'
    (with offload, the blocks in flight) and what is saved outside them, from the forward's end."""
    return min(p.activation.stored, p.memory["activations_peak"])


def format_breakdown(p: Prediction) -> str:
    """One line: the peak's pieces in GB, and the host bytes of the node."""
    b = peak_breakdown(p)
    return (f"peak {b['total'] / 1e9:.1f} GB = parameters {b['params'] / 1e9:.1f} + gradients "
            f"{b['grads'] / 1e9:.1f} + optimizer {b['optimizer'] / 1e9:.1f} + saved activations "
            f"{b['activations_kept'] / 1e9:.1f} + transients of the {b['peak_phase']} phase "
            f"{b['activations_transient'] / 1e9:.1f} + reserve {b['reserved'] / 1e9:.1f}; host "
            f"{p.memory['host_per_node'] / 1e9:,.0f} of {p.host_capacity / 1e9:,.0f} GB per node")


def format_longest(rows: list[Longest], *, header: str) -> str:
    lines = [header, "", "| scheme | longest sequence | tokens | layout | GB/GPU (of which activations) "
             "| host GB/node | bound by | step |", "|---|---|---|---|---|---|---|---|"]
    # host GB/node: offloaded activations, AdamW's pinned partition with optimizer offload and
    # the async checkpoint's staging, over the node's GPUs
    notes = []
    for r in rows:
        if r.best is None:
            lines.append(f"| {r.scheme} | {r.refused or 'nothing fits'} | - | - | - | - | "
                         f"{r.bound or '-'} | - |")
            continue
        m = r.best.memory
        lines.append(f"| {r.scheme} | {r.seq_len / 1024:,.0f}K | {r.seq_len:,} | {r.best.layout.label()} | "
                     f"{m['total'] / 1e9:.1f} ({m['activations_peak'] / 1e9:.1f}) | "
                     f"{m['host_per_node'] / 1e9:,.0f} | {r.bound} | {format_seconds(r.best.step_time)} |")
        notes.append(f"{r.scheme}: {format_breakdown(r.best)}")
    return "\n".join(lines + ([""] + notes if notes else []))


def format_seconds(seconds: float) -> str:
    """A step time as people read it: seconds, minutes or hours."""
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
