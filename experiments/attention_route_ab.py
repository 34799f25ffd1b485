"""TSP against TP with the two CPU attention routes, steps interleaved in one run: `tsp_lse` (the
default: key prefix + causal diagonal merged by log-sum-exp, no mask), `tsp_mask` (the blocked
route: a boolean mask per block of 512 queries) and `tp` (square causal
attention: the same kernel under both routes). The benchmark model of docs/benchmarks.md (h 256,
4 layers, 4 MHA heads, I 688, V 2048), fp32, gloo, 1 thread per rank, dp = 1, one sequence.

Each variant's first step is a warm-up; the timed steps run round-robin (tsp_lse, tsp_mask, tp,
tsp_lse, ...) so that load from other processes hits all alike. Reported: the slowest rank's
median step time per variant and each ratio as the median [min-max] of its per-round ratios.

    .venv/bin/python experiments/attention_route_ab.py --seq-len 4096 --degree 2 --steps 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from tsp_trainer.bench import make_batch, ratio_spread
from tsp_trainer.config import ModelConfig
from tsp_trainer.model import Transformer, layers
from tsp_trainer.model.attention_route import SdpaRoute
from tsp_trainer.parallel.loss import global_count
from tsp_trainer.parallel.mesh import build_mesh
from tsp_trainer.parallel.schemes import parallelize
from tsp_trainer.tools.launch import run_on_ranks

MODEL = dict(vocab_size=2048, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=4,
             intermediate_size=688)


@contextlib.contextmanager
def blocked_mask_route():
    """attention_core on CPU takes the blocked route (a bool mask per block of 512 queries)."""
    original = layers.sdpa_route
    layers.sdpa_route = lambda *a, **k: SdpaRoute("cpu_blocked_mask", query_block=512)
    try:
        yield
    finally:
        layers.sdpa_route = original


def _rank(rank: int, world: int, job: dict) -> dict:
    cfg = ModelConfig(**MODEL, max_seq_len=job["seq_len"])
    mesh = build_mesh(world)
    ids, labels = make_batch(cfg, 1, job["seq_len"], seed=0)
    steps = {}
    for scheme in ("tsp", "tp"):
        with torch.device("meta"):
            model = Transformer(cfg)
        par = parallelize(model, scheme, mesh, seq_len=job["seq_len"], init_seed=0)
        batch = par.local_batch(ids, labels)

        def step(par=par, batch=batch):
            loss_sum, count = par.loss_sum(*batch)
            (loss_sum / global_count(count, par.token_comms)).backward()
            par.model.zero_grad(set_to_none=False)

        steps[scheme] = step
    variants = {"tsp_lse": (steps["tsp"], contextlib.nullcontext),
                "tsp_mask": (steps["tsp"], blocked_mask_route), "tp": (steps["tp"], contextlib.nullcontext)}
    times = {name: [] for name in variants}
    for i in range(job["steps"] + 1):                      # step 0: warm-up
        for name, (step, route) in variants.items():
            with route():
                t0 = time.perf_counter()
                step()
                if i:
                    times[name].append(time.perf_counter() - t0)
    return times


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--degree", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    ranks = run_on_ranks(_rank, args.degree, {"seq_len": args.seq_len, "steps": args.steps}, timeout=3600)
    slowest = {name: [max(r[name][i] for r in ranks) for i in range(args.steps)] for name in ranks[0]}
    med = {name: statistics.median(times) for name, times in slowest.items()}
    out = {"command": "experiments/attention_route_ab.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "seq_len": args.seq_len, "degree": args.degree, "step_time_s": med, "step_times_s": slowest,
           # each ratio: the median [min-max] of the per-round ratios (rounds ran interleaved)
           "tsp_lse / tp": ratio_spread(slowest["tsp_lse"], slowest["tp"]),
           "tsp_mask / tp": ratio_spread(slowest["tsp_mask"], slowest["tp"]),
           "tsp_lse / tsp_mask": ratio_spread(slowest["tsp_lse"], slowest["tsp_mask"])}
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
