"""Achieved fraction of peak per kernel family and GPU: the planner's compute time.

A micro-step's compute is split by kernel family (plan/flops.py `executed_by_family`): GEMMs,
flash attention forward, flash attention backward (FLOPs, at a fraction of the GPU's dense bf16
peak) and memory-bound elementwise kernels (norms, RoPE, SwiGLU, residual adds, the loss's softmax:
bytes, at a fraction of HBM bandwidth):

    t = gemm / (peak e_gemm) + attn_fwd / (peak e_fwd) + attn_bwd / (peak e_bwd)
        + elementwise_bytes / (hbm_bw e_elementwise)

`KERNEL_EFFICIENCY` holds published measurements (docs/planner.md section 4 cites each and says
what it measured); `calibrate` refits the GEMM and attention fractions from a GPU run of
experiments/gpu_acceptance.py (its JSON: the plain 1B model's step and one TSP rank's 7B 128K
step, two mixes of GEMM and attention work), keeping the table's forward / backward attention
ratio and its elementwise fraction:

    python -m tsp_trainer.plan.efficiency docs/results/gpu_acceptance.json --out table.json
    tsp-plan ... --efficiency-table table.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

FAMILIES = ("gemm", "attention_forward", "attention_backward", "elementwise")


@dataclass(frozen=True)
class KernelEfficiency:
    """Fractions of peak: FLOP/s for the three compute families, HBM bandwidth for elementwise."""

    gemm: float
    attention_forward: float
    attention_backward: float
    elementwise: float
    source: str = "published"          # "published" or what it was calibrated from

    def __post_init__(self) -> None:
        for family in FAMILIES:
            value = getattr(self, family)
            if not 0 < value <= 1:
                raise ValueError(f"kernel efficiency {family}={value} must be in (0, 1]")

    def as_dict(self) -> dict:
        return asdict(self)

    def with_single(self, efficiency: float) -> "KernelEfficiency":
        """One fraction for every FLOP family (tsp-plan --efficiency), elementwise kept."""
        return replace(self, gemm=efficiency, attention_forward=efficiency,
                       attention_backward=efficiency, source=f"single {efficiency:g}")


# docs/planner.md section 4 gives the source of every number:
# * gemm: Maximum Achievable Matmul FLOPS (bf16 torch.mm over a search of large shapes) over the
#   dense peak: H100 SXM 794.5 / 989 (the table notes H200 the same), MI300X 668.4 / 1300.
# * attention (H100, H200): FlashAttention-3, head dim 128, 16K tokens, on H100 SXM5: forward
#   620.7 TFLOP/s (pytorch/benchmark's FA3 run), backward 561 TFLOP/s (FA3 paper); the H200 is the
#   same compute die at the same clocks.
# * attention (MI300X): no published training-shape figure found; the H100's attention-to-GEMM
#   ratios applied to the MI300X's GEMM fraction (derived, recalibrate from a run).
# * elementwise: 0.8 of HBM bandwidth, an assumption (not a measurement) for streaming kernels.
KERNEL_EFFICIENCY: dict[str, KernelEfficiency] = {
    "h100": KernelEfficiency(gemm=0.803, attention_forward=0.628, attention_backward=0.567,
                             elementwise=0.8),
    "h200": KernelEfficiency(gemm=0.803, attention_forward=0.628, attention_backward=0.567,
                             elementwise=0.8),
    "mi300x": KernelEfficiency(gemm=0.514, attention_forward=round(0.514 * 0.628 / 0.803, 3),
                               attention_backward=round(0.514 * 0.567 / 0.803, 3), elementwise=0.8),
}


# How much longer the GQA-native attention path (train.attention_gqa=native, model/attention_gqa.py)
# takes than SDPA's fused GQA call for the same forward + backward, by sequence length S: the
# median native / fused ratio of interleaved repeats of llama3_8b's heads (32 q, 8 KV, d 128) in
# bf16 on D = 8, on an H200 (torch 2.11, FA2). "prefix": one TSP item, S / 8 zigzag queries x 4
# heads against S keys x 1 KV head (the calls of schemes that split tokens); "square": one Ulysses
# rank's S queries x 4 heads, square causal (schemes that split no tokens). 131,072 tokens from
# docs/results/gqa_native_cost.json (5 repeats), the longer ones from
# docs/results/gqa_native_cost_long.json (3 repeats); experiments/gqa_native_cost.py's docstring
# gives the commands. The native path's extra launches and merges cost a quarter of a short call
# and nothing measurable by 1M tokens (at 2M it runs 0.8% faster).
GQA_NATIVE_SLOWDOWN = {
    "prefix": ((131072, 1.255), (524288, 1.028), (1048576, 1.008), (2097152, 0.992)),
    "square": ((131072, 1.018), (524288, 1.004)),
}


def gqa_native_slowdown_at(shape: str, seq_len: int) -> float:
    """GQA_NATIVE_SLOWDOWN[shape] at seq_len: linear in log2(S) between the measured lengths, the
    nearest measured value outside them."""
    points = GQA_NATIVE_SLOWDOWN[shape]
    if seq_len <= points[0][0]:
        return points[0][1]
    for (s0, r0), (s1, r1) in zip(points, points[1:]):
        if seq_len <= s1:
            w = math.log2(seq_len / s0) / math.log2(s1 / s0)
            return r0 + w * (r1 - r0)
    return points[-1][1]


def kernel_efficiency(gpu: str) -> KernelEfficiency:
    """The published table's row for `gpu` (a plan/hardware.py profile name)."""
    key = gpu.lower()
    if key not in KERNEL_EFFICIENCY:
        raise ValueError(f"gpu={gpu!r} has no kernel efficiency row; use one of "
                         f"{', '.join(sorted(KERNEL_EFFICIENCY))}")
    return KERNEL_EFFICIENCY[key]


# -- the table as a file ------------------------------------------------------------------------


def write_table(path: str | Path, table: dict[str, KernelEfficiency]) -> None:
    Path(path).write_text(json.dumps({gpu: eff.as_dict() for gpu, eff in table.items()}, indent=1) + "\n")


def read_table(path: str | Path) -> dict[str, KernelEfficiency]:
    """A table written by `write_table` (or by hand): {gpu: {gemm, attention_forward, ...}}."""
    data = json.loads(Path(path).read_text())
    table = {}
    for gpu, row in data.items():
        missing = [f for f in FAMILIES if f not in row]
        if missing:
            raise ValueError(f"{path}: gpu {gpu!r} lacks {', '.join(missing)} (needs {', '.join(FAMILIES)})")
        table[gpu.lower()] = KernelEfficiency(**{f: float(row[f]) for f in FAMILIES},
                                              source=str(row.get("source", path)))
    return table


# -- recalibration from experiments/gpu_acceptance.py ------------------------------------------


def gpu_of_device(name: str) -> str:
    """The profile key of a CUDA device name ("NVIDIA H200" -> "h200")."""
    lowered = name.lower()
    matches = [key for key in KERNEL_EFFICIENCY if key in lowered]
    if not matches:
        raise ValueError(f"device={name!r}: not one of the profiled GPUs ({', '.join(sorted(KERNEL_EFFICIENCY))})")
    return max(matches, key=len)


def _acceptance_workloads(report: dict):
    """The two timed steps of a gpu_acceptance.py report as (name, model, layout, seq_len, tokens,
    step_time_s): the plain model (one process, no AC) and the TSP rank (AC, its S/D tokens)."""
    from tsp_trainer.config.model import model_config
    from tsp_trainer.plan.layout import Layout

    for key in ("plain", "tsp_rank"):
        if key not in report:
            raise ValueError(f"acceptance report: key {key!r} is missing (run gpu_acceptance.py "
                             "without --skip-plain; both timed parts are needed)")
    plain, tsp = report["plain"], report["tsp_rank"]
    yield ("plain", model_config(plain["model"]), Layout("tp", 1), plain["seq_len"], plain["seq_len"],
           plain["ours"]["step_time_s"])
    layout = Layout("tsp", tsp["degree"], activation_checkpointing=True, head_buckets=tsp["head_buckets"])
    yield ("tsp_rank", model_config(tsp["model"]), layout, tsp["seq_len"],
           tsp["seq_len"] // tsp["degree"], tsp["step_time_s"])


def calibrate(report: dict, *, base: KernelEfficiency | None = None,
              gpu: str | None = None) -> tuple[str, KernelEfficiency]:
    """(gpu, efficiencies) fitted to a gpu_acceptance.py report. Two steps, two unknowns: the GEMM
    fraction and the attention forward fraction (backward = forward x the base row's ratio),
    solved from t = gemm/(P e_g) + (fwd + bwd/k)/(P e_f) + elementwise/(B e_m)."""
    from tsp_trainer.plan.flops import executed_by_family
    from tsp_trainer.plan.hardware import get_profile

    gpu = gpu or gpu_of_device(str(report.get("device", "")))
    hw = get_profile(gpu)
    base = base or kernel_efficiency(gpu)
    peak = float(report.get("peak_flops") or hw.peak_flops)
    k = base.attention_backward / base.attention_forward
    rows = []
    for name, cfg, layout, seq, tokens, step_s in _acceptance_workloads(report):
        work = executed_by_family(cfg, layout, seq)
        memory_s = work["elementwise_bytes"] * tokens / (hw.hbm_bw * base.elementwise)
        gemm_s = work["gemm"] * tokens / peak                       # x 1/e_g
        attn_s = (work["attention_forward"] + work["attention_backward"] / k) * tokens / peak   # x 1/e_f
        rows.append((name, gemm_s, attn_s, step_s - memory_s))
    (_, a1, b1, c1), (_, a2, b2, c2) = rows
    det = a1 * b2 - a2 * b1
    if det == 0:
        raise ValueError("acceptance report: the two steps have the same GEMM / attention mix; "
                         "no fit is possible")
    inv_gemm, inv_attn = (c1 * b2 - c2 * b1) / det, (a1 * c2 - a2 * c1) / det
    if inv_gemm < 1 or inv_attn < 1:
        raise ValueError(f"acceptance report: the fit gives e_gemm={1 / inv_gemm if inv_gemm else 0:.3f}, "
                         f"e_attention_forward={1 / inv_attn if inv_attn else 0:.3f}, outside (0, 1] "
                         "(steps faster than the peak allows: check peak_flops and step_time_s)")
    e_attn = 1 / inv_attn
    fitted = KernelEfficiency(gemm=round(1 / inv_gemm, 4), attention_forward=round(e_attn, 4),
                              attention_backward=round(min(1.0, e_attn * k), 4),
                              elementwise=base.elementwise,
                              source=f"calibrated from {report.get('device', gpu)}")
    return gpu, fitted


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tsp_trainer.plan.efficiency",
                                description="fit the kernel efficiency table to an "
                                            "experiments/gpu_acceptance.py JSON")
    p.add_argument("report", help="gpu_acceptance.py --out JSON")
    p.add_argument("--gpu", default=None, help="profile (default: from the report's device name)")
    p.add_argument("--out", required=True, metavar="PATH", help="table JSON (tsp-plan --efficiency-table)")
    args = p.parse_args(argv)
    try:
        gpu, fitted = calibrate(json.loads(Path(args.report).read_text()), gpu=args.gpu)
    except (ValueError, KeyError) as err:
        print(f"efficiency: error: {err}", file=sys.stderr)
        return 2
    table = dict(KERNEL_EFFICIENCY)
    table[gpu] = fitted
    write_table(args.out, table)
    print(f"{gpu}: " + ", ".join(f"{f} {getattr(fitted, f):.3f}" for f in FAMILIES) + f" -> {args.out}")
    return 0


__all__ = ["FAMILIES", "GQA_NATIVE_SLOWDOWN", "KERNEL_EFFICIENCY", "gqa_native_slowdown_at", "KernelEfficiency", "calibrate", "gpu_of_device",
           "kernel_efficiency", "read_table", "write_table"]

if __name__ == "__main__":
    sys.exit(main())
