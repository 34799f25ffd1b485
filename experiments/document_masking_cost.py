"""What document masking costs: step time of a packed batch of N documents against one
document, and the per-rank peak of activations + transients with masking against without, on the
benchmark model of docs/benchmarks.md (h 256, 4 layers, 4 MHA heads, I 688, V 2048, fp32, gloo,
1 thread per rank), one TSP group of D ranks, dp = 1.

Variants, on the same weights and tokens:
  off       no document masking (the whole row is one causal sequence)
  docs1     masking on, one document (the row): the masked path's overhead on its own
  docsN     masking on, N documents of S / N tokens (work ~ N (S/N)^2 / 2 = S^2 / (2N))
Each variant's first step is tracked for memory (LiveTensorMemory, as tsp-bench), the timed steps
run round-robin (off, docs1, docsN, off, ...) so that load from other processes on a shared
machine hits all alike; report medians, and each time ratio as the median [min-max] of its
per-round ratios.

    .venv/bin/python experiments/document_masking_cost.py --seq-len 16384 --degree 4 --documents 16 \
        --steps 3 --json docs/results/document_masking_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from tsp_trainer.bench import StepRunner, make_batch, ratio_spread
from tsp_trainer.config import ModelConfig
from tsp_trainer.model import Transformer
from tsp_trainer.model.documents import Documents
from tsp_trainer.parallel.loss import global_count
from tsp_trainer.parallel.mesh import build_mesh
from tsp_trainer.parallel.schemes import parallelize
from tsp_trainer.tools.launch import run_on_ranks

MODEL = dict(vocab_size=2048, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=4,
             intermediate_size=688)


def _rank(rank: int, world: int, job: dict) -> dict:
    cfg = ModelConfig(**MODEL, max_seq_len=job["seq_len"])
    mesh = build_mesh(world)
    with torch.device("meta"):
        model = Transformer(cfg)
    par = parallelize(model, job["scheme"], mesh, seq_len=job["seq_len"], init_seed=0)
    ids, labels = make_batch(cfg, 1, job["seq_len"], seed=0)
    n, s = job["documents"], job["seq_len"]
    variants = {"off": None, "docs1": Documents.from_lengths([[s]]),
                f"docs{n}": Documents.from_lengths([[s // n] * (n - 1) + [s - (s // n) * (n - 1)]])}
    runners = {}
    for name, docs in variants.items():
        batch = list(par.local_batch(ids, labels, docs))

        def fwd_bwd(batch=batch):
            loss_sum, count = par.loss_sum(*batch)
            total = global_count(count, par.token_comms)
            (loss_sum / total).backward()
            return loss_sum, total

        runners[name] = StepRunner(model, fwd_bwd, batch, torch.device("cpu"), None)
    for run in runners.values():          # each variant's first step: memory (and warm-up)
        run.memory_step()
    for _ in range(job["steps"]):
        for run in runners.values():
            run.times.append(run.step())
    return {name: {"peak_act_bytes": run.peak, "step_times": run.times} for name, run in runners.items()}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--degree", type=int, default=4)
    ap.add_argument("--documents", type=int, default=16)
    ap.add_argument("--scheme", default="tsp")
    ap.add_argument("--steps", type=int, default=3, help="interleaved rounds (>= 3 for a median)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    job = {"seq_len": args.seq_len, "documents": args.documents, "scheme": args.scheme, "steps": args.steps}
    ranks = run_on_ranks(_rank, args.degree, job, timeout=3600)
    docs_n = f"docs{args.documents}"
    out = {"command": "experiments/document_masking_cost.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "model": MODEL, **job, "degree": args.degree, "variants": {}}
    for name in ranks[0]:
        times = [max(r[name]["step_times"][i] for r in ranks) for i in range(args.steps)]   # slowest rank
        out["variants"][name] = {"peak_act_mib_max_rank": max(r[name]["peak_act_bytes"] for r in ranks) / 2**20,
                                 "step_times_s": times, "step_time_s": statistics.median(times)}
    v = out["variants"]
    # time ratios: the median [min-max] of the per-round ratios (the rounds ran interleaved)
    out["ratios"] = {f"time {docs_n} / docs1": ratio_spread(v[docs_n]["step_times_s"], v["docs1"]["step_times_s"]),
                     "time docs1 / off": ratio_spread(v["docs1"]["step_times_s"], v["off"]["step_times_s"]),
                     f"peak {docs_n} / off": v[docs_n]["peak_act_mib_max_rank"] / v["off"]["peak_act_mib_max_rank"],
                     "peak docs1 / off": v["docs1"]["peak_act_mib_max_rank"] / v["off"]["peak_act_mib_max_rank"]}
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return out


if __name__ == "__main__":
    main()
