"""Cost of tiling where memory does not need it, on CPU: TSP with the loss and the MLP untiled,
each tiled alone and both tiled (`--chunks` chunks of the local tokens), in one launch of D gloo
ranks with tsp-bench's builder, timed steps interleaved, same weights and batch.

    python experiments/tiling_cost.py [--degree 2] [--seq-len 4096] [--chunks 4] [--steps 5] \\
        [--dtype fp32] [--out docs/results/tiling_cost.json]

Each ratio is a variant's step over the untiled step, step by step (median [min-max] over the
interleaved steps, tsp_trainer.bench.ratio_spread). The first losses are printed too: tiling
changes the order of sums only. In fp32 the accumulators are fp32 whether tiled or not; a tiled
layer's activation-dtype accumulators differ only in bf16 (--dtype bf16).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tsp_trainer.bench import format_spread, interleaved_ranks, ratio_spread
from tsp_trainer.config.model import model_config
from tsp_trainer.tools import launch

# a chunk larger than any rank's tokens: the block takes them all at once
UNTILED = 1 << 62


def variants(local_tokens: int, chunks: int) -> dict[str, dict]:
    """The parallelize options of each variant: loss and MLP chunk settings."""
    chunk = max(1, -(-local_tokens // chunks))
    return {"untiled": {"loss_chunk_tokens": UNTILED, "mlp_chunk_tokens": UNTILED},
            "tiled loss": {"loss_chunk_tokens": chunk, "mlp_chunk_tokens": UNTILED},
            "tiled MLP": {"loss_chunk_tokens": UNTILED, "mlp_chunk_tokens": chunk},
            "tiled loss + MLP": {"loss_chunk_tokens": chunk, "mlp_chunk_tokens": chunk}}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="tiling_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--degree", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--chunks", type=int, default=4, help="chunks of the local tokens when tiled")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.chunks < 2:
        p.error(f"--chunks={args.chunks} must be >= 2 (one chunk is the untiled variant)")
    cfg = model_config("tiny", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=4,
                       intermediate_size=688, vocab_size=2048, max_seq_len=args.seq_len)
    common = {"scheme": "tsp", "model": cfg, "seq_len": args.seq_len, "micro_batch": 1,
              "steps": args.steps, "warmup": 1, "seed": 0, "backend": "gloo", "dtype": args.dtype,
              "activation_checkpointing": False}
    named = variants(args.seq_len // args.degree, args.chunks)
    jobs = [{**common, "options": {"head_buckets": 1, **opts}} for opts in named.values()]
    ranks = launch.run_on_ranks(interleaved_ranks, args.degree, jobs, backend="gloo", threads=1)
    out = {"variants": {}, "ratios": {}}
    for i, name in enumerate(named):
        times = [max(r[i]["step_times"][k] for r in ranks) for k in range(args.steps)]
        out["variants"][name] = {"step_times_s": times, "first_loss": ranks[0][i]["first_loss"],
                                 "peak_act_bytes": ranks[0][i]["peak_act_bytes"], **named[name]}
    base = out["variants"]["untiled"]["step_times_s"]
    for name in list(named)[1:]:
        out["ratios"][f"{name} / untiled"] = ratio_spread(out["variants"][name]["step_times_s"], base)
    out["setup"] = {"degree": args.degree, "seq_len": args.seq_len, "chunks": args.chunks,
                    "dtype": args.dtype, "model": "h256 L4 MHA I688 V2048", "threads_per_rank": 1}
    for key, spread in out["ratios"].items():
        print(f"{key}: {format_spread(spread)}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
    sys.exit(0)
