"""Cost of train.offload_activations on CPU: TSP with and without it in one launch of D gloo ranks,
timed steps interleaved (tsp-bench's `interleaved_ranks`), same weights and batch.

    python experiments/offload_cost.py [--degree 2] [--seq-len 4096] [--steps 3] [--out docs/results/offload_cost.json]

On CPU "host memory" is the same memory: the offload copies each block's saved tensors into a
separate buffer and back, so this measures the copies' time (and that the loss is unchanged), not
a memory saving; on a GPU the copies run on a side stream (model/offload.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tsp_trainer.bench import interleaved_ranks, ratio_spread
from tsp_trainer.config.model import model_config
from tsp_trainer.tools import launch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="offload_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--degree", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    cfg = model_config("tiny", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=4,
                       intermediate_size=688, vocab_size=2048, max_seq_len=args.seq_len)
    common = {"scheme": "tsp", "options": {"head_buckets": 1}, "model": cfg, "seq_len": args.seq_len,
              "micro_batch": 1, "steps": args.steps, "warmup": 1, "seed": 0, "backend": "gloo",
              "dtype": "fp32", "activation_checkpointing": False}
    jobs = [{**common, "offload_activations": False}, {**common, "offload_activations": True}]
    ranks = launch.run_on_ranks(interleaved_ranks, args.degree, jobs, backend="gloo", threads=1)
    out = {}
    for i, name in enumerate(("plain", "offload")):
        times = [max(r[i]["step_times"][k] for r in ranks) for k in range(args.steps)]
        out[name] = {"step_times_s": times, "median_s": sorted(times)[len(times) // 2],
                     "first_loss": ranks[0][i]["first_loss"], "peak_act_bytes": ranks[0][i]["peak_act_bytes"]}
    # the median [min-max] of the per-step ratios (the steps ran interleaved)
    out["offload_over_plain"] = ratio_spread(out["offload"]["step_times_s"], out["plain"]["step_times_s"])
    out["setup"] = {"degree": args.degree, "seq_len": args.seq_len, "model": "h256 L4 MHA I688 V2048",
                    "threads_per_rank": 1}
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
