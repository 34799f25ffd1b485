"""The longest sequence each scheme can train on a cluster (`tsp-plan --max-seq-len`).

For one scheme, a sequence length S "fits" when some layout of that scheme (any D, DP, ZeRO stage,
activation checkpointing, head buckets, micro-batch; plan/search.py's candidates) fits in GPU
memory under the planner's memory model (plan/predict.py). Memory grows with S for every layout,
so the longest S is found by doubling until nothing fits, then bisecting, on multiples of
`granule` tokens (1,024 by default: a multiple of 2D for every D the search tries).
"""

from __future__ import annotations

from dataclasses import dataclass

from tsp_trainer.config import ModelConfig
from tsp_trainer.plan.layout import Layout
from tsp_trainer.plan.precision import BF16, Precision
from tsp_trainer.plan.predict import Assumptions, Prediction, predict
from tsp_trainer.plan.hardware import HardwareProfile
from tsp_trainer.plan.search import candidate_layouts

LIMIT_TOKENS = 1 << 27          # 134M tokens: the search stops here


@dataclass
class Longest:
    scheme: str
    seq_len: int                         # 0: not even one granule fits
    best: Prediction | None              # the fitting layout with the least memory at seq_len
    refused: str = ""                    # why no layout was tried (a pair the trainer refuses)

    def as_dict(self) -> dict:
        out = {"scheme": self.scheme, "max_seq_len": self.seq_len}
        if self.refused:
            out["refused"] = self.refused
        if self.best is not None:
            out.update(layout=self.best.layout.label(), memory=self.best.memory,
                       tokens_per_s=self.best.tokens_per_s, mfu=self.best.mfu)
        return out


def _fitting(cfg: ModelConfig, scheme: str, seq_len: int, *, hw: HardwareProfile, world: int,
             global_batch: int, prec: Precision, assumptions: Assumptions, max_degree: int,
             offload: bool, tsp_recompute: str = "full",
             offload_optimizer: bool = False) -> Prediction | None:
    """The layout of `scheme` with the least memory at seq_len, if it fits."""
    model = cfg.replace(max_seq_len=max(cfg.max_seq_len, seq_len))
    layouts = candidate_layouts(model, seq_len=seq_len, global_batch=global_batch, world=world,
                                schemes=(scheme,), max_degree=max_degree, zero_stages=prec.zero_stages,
                                micro_batches=(1,), tsp_recompute=(tsp_recompute,),
                                offload_optimizer=offload_optimizer)
    best = None
    for lay in layouts:
        if offload:                   # always full: longest_seq_len refuses the others first
            lay = Layout(**{**lay.as_dict(), "offload_activations": True})
        p = predict(model, lay, seq_len, hw, global_batch=global_batch, prec=prec, assumptions=assumptions)
        if p.fits and (best is None or p.memory["total"] < best.memory["total"]):
            best = p
    return best


def longest_seq_len(cfg: ModelConfig, scheme: str, *, hw: HardwareProfile, nodes: int,
                    global_batch: int = 1, prec: Precision = BF16,
                    assumptions: Assumptions = Assumptions(), max_degree: int = 64,
                    offload: bool = False, granule: int = 1024, tsp_recompute: str = "full",
                    offload_optimizer: bool = False) -> Longest:
    """Largest multiple of `granule` tokens that some layout of `scheme` fits (doubling, then
    bisection); TSP layouts with `tsp_recompute` (selective or none: nothing with activation
    offload, the trainer refuses the pair); `offload_optimizer`: AdamW's state in host memory
    (ZeRO-Offload) in every layout."""
    world = nodes * hw.gpus_per_node
    if offload and scheme == "tsp" and tsp_recompute != "full":
        return Longest(scheme, 0, None, refused=f"tsp_recompute={tsp_recompute} is refused with "
                                                "activation offload (--tsp-recompute full)")

    def fit(units: int):
        return _fitting(cfg, scheme, units * granule, hw=hw, world=world, global_batch=global_batch,
                        prec=prec, assumptions=assumptions, max_degree=max_degree, offload=offload,
                        tsp_recompute=tsp_recompute, offload_optimizer=offload_optimizer)

    lo, lo_pred = 0, None                      # lo units fit (0: trivially)
    hi = 1
    while hi * granule <= LIMIT_TOKENS:
        p = fit(hi)
        if p is None:
            break
        lo, lo_pred, hi = hi, p, hi * 2
    else:
        return Longest(scheme, lo * granule, lo_pred)
    while hi - lo > 1:                         # invariant: lo fits, hi does not
        mid = (lo + hi) // 2
        p = fit(mid)
        if p is None:
            hi = mid
        else:
            lo, lo_pred = mid, p
    return Longest(scheme, lo * granule, lo_pred)


def format_longest(rows: list[Longest], *, header: str) -> str:
    lines = [header, "", "| scheme | longest sequence | tokens | layout | GB/GPU (of which activations) | host GB/GPU |",
             "|---|---|---|---|---|---|"]
    # host GB/GPU: offloaded activations plus, with optimizer offload, AdamW's pinned partition
    for r in rows:
        if r.best is None:
            lines.append(f"| {r.scheme} | {r.refused or 'nothing fits'} | - | - | - | - |")
            continue
        m = r.best.memory
        lines.append(f"| {r.scheme} | {r.seq_len / 1024:,.0f}K | {r.seq_len:,} | {r.best.layout.label()} | "
                     f"{m['total'] / 1e9:.1f} ({m['activations_peak'] / 1e9:.1f}) | "
                     f"{(m['host_offloaded'] + m['host_optimizer']) / 1e9:.1f} |")
    return "\n".join(lines)
