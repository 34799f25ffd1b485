"""Where a scheme's step time goes on CPU: compute against communication, measured two ways in one
command, schemes interleaved step by step (the machine's noise hits them alike).

    python experiments/cpu_split.py [--degree 4] [--seq-len 4096] [--steps 7]
                              [--schemes tsp:selective,tsp:full,tp] [--out docs/results/cpu_split.json]

1. gloo ranks: D processes (1 thread each), every scheme built by tsp-bench's builder on the same
   weights and batch, one step (forward + backward + AdamW, as tsp-bench times it) of each in turn; per rank the wall time and the process CPU time
   (time.process_time) of the step. On 2 cores and D = 4 ranks the cores are saturated, so the
   wall time is about the CPU time summed over the ranks / cores, plus idle waiting: extra CPU
   work of any kind, compute or gloo's, shows directly.
2. compute only: rank 0 of the same D-rank group on torch's fake process group (plan/dry_run.py
   `fake_world`) in this process: collectives return at once, so its CPU time is the rank's
   compute and Python alone. (1) minus (2) per rank is what communication costs the CPU.

The model is tsp-bench's benchmark model (h 256, 4 layers, 4 heads, I 688, V 2048, fp32).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tsp_trainer.bench import format_spread, ratio_spread
from tsp_trainer.config.model import model_config
from tsp_trainer.tools import launch


def _model(seq_len: int):
    return model_config("tiny", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=4,
                        intermediate_size=688, vocab_size=2048, max_seq_len=seq_len)


def _runners(degree: int, seq_len: int, schemes: list[tuple[str, str]]):
    """One tsp-bench step runner per scheme (tsp_trainer/bench/run.py: same weights and batch, forward +
    backward + AdamW step), each warmed up by one step."""
    import torch.distributed as dist

    from tsp_trainer.bench import build_scheme

    runners = []
    for scheme, recompute in schemes:
        options = {"head_buckets": 1, "tsp_recompute": recompute} if scheme == "tsp" else {}
        job = {"scheme": scheme, "options": options, "model": _model(seq_len), "seq_len": seq_len,
               "micro_batch": 1, "seed": 0, "backend": "gloo", "dtype": "fp32",
               "activation_checkpointing": False}
        run, _ = build_scheme(dist.get_rank(), degree, job)
        run.step()                                          # warm-up
        runners.append(run)
    return runners


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _gloo_rank(rank: int, world: int, seq_len: int, schemes, steps: int) -> dict:
    import torch.distributed as dist

    runs = _runners(world, seq_len, schemes)
    wall = [[] for _ in runs]
    cpu = [[] for _ in runs]
    for _ in range(steps):
        for i, run in enumerate(runs):                     # interleaved
            dist.barrier()
            w, c = time.perf_counter(), time.process_time()
            run.step()
            dist.barrier()                                 # the step ends when every rank is done
            wall[i].append(time.perf_counter() - w)
            cpu[i].append(time.process_time() - c)
    return {"wall_s": [_median(w) for w in wall], "cpu_s": [_median(c) for c in cpu],
            "wall_steps_s": wall, "cpu_steps_s": cpu}


def _compute_only(degree: int, seq_len: int, schemes, steps: int) -> list[float]:
    from tsp_trainer.plan.dry_run import fake_world

    with fake_world(degree, 0):
        runs = _runners(degree, seq_len, schemes)
        cpu = [[] for _ in runs]
        for _ in range(steps):
            for i, run in enumerate(runs):
                c = time.process_time()
                run.step()
                cpu[i].append(time.process_time() - c)
    return [_median(c) for c in cpu]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="cpu_split", description=__doc__.split("\n\n")[0])
    p.add_argument("--degree", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--schemes", default="tsp:selective,tsp:full,tp",
                   help="comma-separated scheme[:tsp_recompute]; the last is the reference")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    schemes = [tuple((s + ":full").split(":")[:2]) for s in args.schemes.split(",")]
    ranks = launch.run_on_ranks(_gloo_rank, args.degree, args.seq_len, schemes, args.steps,
                                backend="gloo", threads=1)
    import torch

    torch.set_num_threads(1)
    compute = _compute_only(args.degree, args.seq_len, schemes, args.steps)
    rows = []
    for i, (scheme, recompute) in enumerate(schemes):
        cpu_ranks = [r["cpu_s"][i] for r in ranks]
        rows.append({"scheme": scheme, "tsp_recompute": recompute if scheme == "tsp" else None,
                     "wall_s": max(r["wall_s"][i] for r in ranks),
                     "cpu_s_per_rank": cpu_ranks, "cpu_s_summed": sum(cpu_ranks),
                     "compute_only_cpu_s_rank0": compute[i],
                     "comm_cpu_s_rank0": cpu_ranks[0] - compute[i]})
    ref = len(schemes) - 1
    for i, row in enumerate(rows):        # per-step ratios to the reference: median [min-max]
        wall = [max(r["wall_steps_s"][i][k] for r in ranks) for k in range(args.steps)]
        ref_wall = [max(r["wall_steps_s"][ref][k] for r in ranks) for k in range(args.steps)]
        cpu = [sum(r["cpu_steps_s"][i][k] for r in ranks) for k in range(args.steps)]
        ref_cpu = [sum(r["cpu_steps_s"][ref][k] for r in ranks) for k in range(args.steps)]
        row["wall_over_ref"] = ratio_spread(wall, ref_wall)
        row["cpu_summed_over_ref"] = ratio_spread(cpu, ref_cpu)
    ref = rows[-1]
    print(f"D = {args.degree} gloo ranks x 1 thread, {args.seq_len} tokens, median of {args.steps} "
          f"interleaved steps; ratios to {ref['scheme']} (wall and CPU: median [min-max] of the per-step "
          f"ratios)")
    print(f"{'scheme':16s} {'wall s':>7s} {'ratio':>18s} {'CPU s (sum)':>11s} {'ratio':>18s} "
          f"{'compute s (r0)':>14s} {'ratio':>6s} {'comm CPU s (r0)':>15s}")
    for r in rows:
        name = r["scheme"] + (f":{r['tsp_recompute']}" if r["tsp_recompute"] else "")
        print(f"{name:16s} {r['wall_s']:7.3f} {format_spread(r['wall_over_ref']):>18s} "
              f"{r['cpu_s_summed']:11.3f} {format_spread(r['cpu_summed_over_ref']):>18s} "
              f"{r['compute_only_cpu_s_rank0']:14.3f} "
              f"{r['compute_only_cpu_s_rank0'] / ref['compute_only_cpu_s_rank0']:6.2f} "
              f"{r['comm_cpu_s_rank0']:15.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"degree": args.degree, "seq_len": args.seq_len,
                                              "steps": args.steps, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
