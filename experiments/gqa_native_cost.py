"""What the GQA-native attention path and the chunked RMSNorm cost at 128K on one CUDA GPU, where
memory does not need them: kernel time of a forward + backward and the backward's peak, against
SDPA's own GQA (one fused flash call with enable_gqa) and torch's one-pass F.rms_norm.

Shapes of llama3_8b (32 query heads, 8 K/V heads, d 128, h 4096) at 131,072 tokens on D = 8:
  tsp_item      one TSP attention item of the rank with the longest key prefix: its 16,384 zigzag
                queries (two runs of 8,192) x 4 query heads against 131,072 keys x 1 K/V head
                (a layer runs 8 such items);
  ulysses_rank  one Ulysses rank after its all-to-all: 131,072 queries x 4 heads, square causal;
  rms_norm      one rank's [16,384, 4,096] block input.

Variants run round-robin (a, b, a, b, ...) after two warm-ups, each repeat timed with CUDA events;
reported: the median milliseconds per variant and the ratio native / fused as median [min-max] of
the per-round ratios.

    python experiments/gqa_native_cost.py --repeats 5 --out docs/results/gqa_native_cost.json

--seq-len takes the same shapes at another length (the TSP item's queries S / 8 against S keys),
--cases a subset; docs/results/gqa_native_cost_long.json holds the runs at 512K, 1M and 2M:

    python experiments/gqa_native_cost.py --repeats 3 --seq-len 524288 --cases tsp_item,ulysses_rank
    python experiments/gqa_native_cost.py --repeats 3 --seq-len 1048576 --cases tsp_item
    python experiments/gqa_native_cost.py --repeats 3 --seq-len 2097152 --cases tsp_item
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from tsp_trainer.bench import ratio_spread
from tsp_trainer.model.attention_route import SdpaRoute, sdpa_route
from tsp_trainer.model.layers import PositionRuns, attention_core
from tsp_trainer.model.rms_norm import rms_norm

SEQ, DEGREE, HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 131072, 8, 32, 8, 128, 4096
HEADS_ITEM, KV_ITEM = HEADS // DEGREE, KV_HEADS // DEGREE


def _zigzag_rank0() -> PositionRuns:
    """Rank 0's two zigzag chunks of SEQ tokens over DEGREE ranks: the first and the last."""
    c = SEQ // (2 * DEGREE)
    return PositionRuns(((0, c), ((2 * DEGREE - 1) * c, c)))


def _attention_case(shape: str):
    """(inputs builder, q_runs) of one attention shape; inputs bf16 on the GPU."""
    runs = _zigzag_rank0() if shape == "tsp_item" else None
    tq = SEQ // DEGREE if runs is not None else SEQ

    def inputs():
        gen = torch.Generator(device="cuda").manual_seed(0)
        kw = dict(device="cuda", dtype=torch.bfloat16, generator=gen)
        q = torch.randn(1, tq, HEADS_ITEM, HEAD_DIM, **kw).requires_grad_()
        k, v = (torch.randn(1, SEQ, KV_ITEM, HEAD_DIM, **kw).requires_grad_() for _ in range(2))
        return q, k, v

    return inputs, (None if runs is None else runs.query_runs())


def _timed(fn) -> tuple[float, int]:
    """Milliseconds of fn() between CUDA events, and the peak bytes allocated above the start."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end), torch.cuda.max_memory_allocated() - base


def _attention_step(inputs, q_runs, route):
    q, k, v = inputs

    def step():
        out = attention_core(q, k, v, q_runs, route=route)
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    return step


def _norm_step(x, w, one_pass: bool):
    def step():
        y = F.rms_norm(x, (HIDDEN,), w, 1e-5) if one_pass else rms_norm(x, w, 1e-5)
        torch.autograd.grad(y, (x, w), torch.ones_like(y))
    return step


def _compare(variants: dict, repeats: int) -> dict:
    """Round-robin timing of {name: step}; the first name is the numerator of the ratio."""
    for step in variants.values():
        for _ in range(2):
            _timed(step)
    ms = {name: [] for name in variants}
    peak = {}
    for _ in range(repeats):
        for name, step in variants.items():
            t, p = _timed(step)
            ms[name].append(t)
            peak[name] = max(peak.get(name, 0), p)
    a, b = variants
    return {"ms": {n: statistics.median(v) for n, v in ms.items()}, "ms_all": ms,
            "peak_bytes": peak, "ratio": ratio_spread(ms[a], ms[b])}


def main(argv=None) -> dict:
    global SEQ
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None, help="JSON path of the results")
    ap.add_argument("--seq-len", type=int, default=SEQ, help="tokens of the sequence (a multiple of 16)")
    ap.add_argument("--cases", default="tsp_item,ulysses_rank,rms_norm", help="comma-separated cases")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("experiments/gqa_native_cost.py needs a CUDA device")
    SEQ, cases = args.seq_len, args.cases.split(",")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "seq_len": SEQ, "cases": {}}
    native = sdpa_route("cuda", torch.bfloat16, gqa=True, head_dim=HEAD_DIM, gqa_path="native")
    for shape in ("tsp_item", "ulysses_rank"):
        if shape not in cases:
            continue
        build, q_runs = _attention_case(shape)
        inputs = build()
        results["cases"][shape] = _compare(
            {"native": _attention_step(inputs, q_runs, native),
             "fused": _attention_step(inputs, q_runs, SdpaRoute("flash"))}, args.repeats)
        del inputs
        torch.cuda.empty_cache()
    if "rms_norm" in cases:
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(SEQ // DEGREE, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
        w = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        results["cases"]["rms_norm"] = _compare({"chunked": _norm_step(x, w, False),
                                                 "one_pass": _norm_step(x, w, True)}, args.repeats)
    for name, case in results["cases"].items():
        r = case["ratio"]
        print(f"{name}: " + ", ".join(f"{n} {t:.3f} ms (peak {case['peak_bytes'][n] / 2**20:,.0f} MiB)"
                                       for n, t in case["ms"].items())
              + f"; ratio {r['median']:.3f} [{r['min']:.3f}-{r['max']:.3f}] over {r['repeats']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
