"""Per-op profile of one training step (tsp-bench --profile): torch.profiler's self CPU time per
op (self CUDA time too on GPUs), the top ops, and the same time grouped into the kinds of work
that explain a scheme's overhead: attention (SDPA and its backward), matmuls, communication
(waits and collectives), norms, copies (cat / copy / contiguous / fills), other elementwise.

Self time counts each op once (a parent op's time excludes its children), so the groups add up
to the step's total op time. On gloo, a collective's self time is mostly waiting for the peer.
"""

from __future__ import annotations

import torch

# (group, words): the first group one of whose words the lower-cased op name contains
GROUPS = (
    ("attention", ("scaled_dot_product", "sdpa", "softmax", "flash", "efficient")),
    # collectives, and the autograd nodes whose own time is a synchronous collective's wait
    # (gradient sums over a group, Megatron's region entries / exits)
    ("comm", ("c10d", "gloo", "nccl", "broadcast", "all_gather", "allgather", "reduce_scatter",
              "allreduce", "all_reduce", "send", "recv", "wait", "barrier", "record_param_comms",
              "sumgradovergroup", "region")),
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm",
                "gemm")),
    ("norm", ("rsqrt", "aten::pow", "aten::mean", "rmsnorm", "rms_norm")),
    ("copy", ("copy", "aten::cat", "contiguous", "aten::clone", "aten::zero", "aten::fill",
              "aten::empty", "aten::to", "index", "aten::stack", "aten::repeat", "aten::flip")),
    # the Python of our autograd functions (TSP's blocks, vocab-parallel loss): loop overhead and
    # the waits on their asynchronous ops (prefetched broadcasts, ring exchanges)
    ("autograd fn (python + async waits)", ("fn", "crossentropy", "vocabparallel")),
)


def op_group(name: str) -> str:
    low = name.lower()
    for group, words in GROUPS:
        if any(w in low for w in words):
            return group
    return "other"


def profile_step(fwd_bwd, device: torch.device, *, top: int = 15) -> dict:
    """Profile one call of fwd_bwd (forward + backward); self time per op, grouped (seconds)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fwd_bwd()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    rows = []
    for ev in prof.key_averages():
        cpu = ev.self_cpu_time_total / 1e6
        dev = getattr(ev, "self_device_time_total", 0.0) / 1e6 if device.type == "cuda" else 0.0
        if cpu or dev:
            rows.append({"op": ev.key, "self_cpu_s": cpu, "self_device_s": dev, "count": ev.count,
                         "group": op_group(ev.key)})
    rows.sort(key=lambda r: -(r["self_device_s"] or r["self_cpu_s"]))
    groups: dict[str, float] = {}
    for r in rows:
        groups[r["group"]] = groups.get(r["group"], 0.0) + (r["self_device_s"] or r["self_cpu_s"])
    return {"total_s": sum(groups.values()), "groups_s": dict(sorted(groups.items(), key=lambda kv: -kv[1])),
            "top": rows[:top], "clock": "device" if device.type == "cuda" else "cpu"}


def format_profiles(rows: list[dict]) -> str:
    """Per scheme: the grouped self time (seconds and share) and its top ops."""
    lines = []
    for row in rows:
        prof = row.get("profile")
        if not prof:
            continue
        total = prof["total_s"] or 1.0
        groups = ", ".join(f"{g} {s:.2f} s ({s / total:.0%})" for g, s in prof["groups_s"].items())
        lines.append(f"profile {row['scheme']} (rank 0, one step, self {prof['clock']} time "
                     f"{prof['total_s']:.2f} s): {groups}")
        for r in prof["top"][:8]:
            t = r["self_device_s"] or r["self_cpu_s"]
            lines.append(f"    {t:8.3f} s  {r['count']:6d}x  [{r['group']}] {r['op']}")
    return "\n".join(lines)
