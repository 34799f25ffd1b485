"""What gloo's collectives cost on CPU against the direct exchanges Comm runs instead
(parallel/comm.py "Direct exchanges on gloo"): per op, wall time and CPU time summed over the
ranks, gloo's own op and the direct one side by side in one launch (interleaved repeats), through
`Comm` itself (`direct_exchanges` switched per call), at the sizes TSP's attention moves in the
tsp-bench model (h 256, 4 heads, fp32) at 4K tokens.

    python experiments/gloo_collectives.py [--degrees 2 4] [--repeats 30] [--out docs/results/gloo_collectives.json]

Ops: the K/V all-gather of one item (this rank's [T, 2, 64] in fp32 -> D of them), the dK/dV
reduce-scatter (the inverse), and for reference the ops Comm leaves to gloo: an all-reduce of TP's
activation [4096, 256] fp32, the attention's weight-shard broadcast and weight-gradient reduce
(one per owner, a [4 x 64 x 256] fp32 shard each).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tsp_trainer.tools import launch

SEQ, HIDDEN, HEADS = 4096, 256, 4


def _ops(comm, world: int):
    """name -> (call, direct?) at the tsp-bench model's sizes; direct None: gloo's op only."""
    import torch

    tokens = SEQ // world
    kv = torch.ones(tokens, 2, HIDDEN // HEADS)                          # one item's local K/V
    gathered = torch.empty((world * tokens,) + kv.shape[1:])
    dkv = torch.ones((world * tokens,) + kv.shape[1:])
    mine = torch.empty(kv.shape)
    act = torch.ones(SEQ, HIDDEN)                                       # TP's all-reduce
    shard = torch.ones(4 * (HIDDEN // world) * HIDDEN)                  # W_q, W_k, W_v, W_o rows

    def all_gather():
        comm.all_gather(gathered, kv, tag="bench.kv")

    def reduce_scatter():
        comm.reduce_scatter(mine, dkv, tag="bench.dkv")

    def all_reduce():
        comm.all_reduce(act, tag="bench.act")

    def broadcasts():
        for r in range(world):
            comm.broadcast(shard, r, tag="bench.w")

    def reduces():
        for r in range(world):
            comm.reduce(shard, r, tag="bench.wgrad")

    return {
        f"all_gather {kv.numel() * 4 // 1024} KiB/rank": (all_gather, True),
        f"reduce_scatter {dkv.numel() * 4 // 1024} KiB": (reduce_scatter, True),
        f"all_reduce {act.numel() * 4 // 1024} KiB": (all_reduce, None),
        f"broadcast x{world} owners, {shard.numel() * 4 // 1024} KiB": (broadcasts, None),
        f"reduce x{world} owners, {shard.numel() * 4 // 1024} KiB": (reduces, None),
    }


def _measure(rank: int, world: int, repeats: int) -> dict:
    import torch
    import torch.distributed as dist

    from tsp_trainer.parallel.mesh import build_mesh

    comm = build_mesh(world).tsp
    out = {}
    for name, (call, direct) in _ops(comm, world).items():
        kinds = {"gloo": False, "direct": True} if direct else {"gloo": False}
        times = {k: [] for k in kinds}
        for _ in range(repeats):
            for kind, flag in kinds.items():            # interleaved: the same machine state
                comm.direct_exchanges = flag
                dist.barrier()
                wall, cpu = time.perf_counter(), time.process_time()
                call()
                times[kind].append((time.perf_counter() - wall, time.process_time() - cpu))
        for kind, ts in times.items():
            walls = sorted(t[0] for t in ts)
            cpus = torch.tensor([sum(t[1] for t in ts) / repeats])
            every = [torch.zeros(1) for _ in range(world)]
            dist.all_gather(every, cpus)
            out[f"{name} [{kind}]"] = {"wall_ms": 1e3 * walls[len(walls) // 2],
                                       "cpu_ms_summed_over_ranks": 1e3 * float(sum(every))}
    comm.direct_exchanges = True
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="gloo_collectives", description=__doc__.split("\n\n")[0])
    p.add_argument("--degrees", type=int, nargs="+", default=[2, 4])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    result = {}
    for world in args.degrees:
        rows = launch.run_on_ranks(_measure, world, args.repeats, backend="gloo", threads=1)[0]
        result[f"D={world}"] = rows
        print(f"D = {world} gloo ranks, 1 thread each ({args.repeats} interleaved repeats)")
        print(f"  {'op':48s} {'wall ms':>8s} {'CPU ms (sum)':>13s}")
        for name, r in rows.items():
            print(f"  {name:48s} {r['wall_ms']:8.2f} {r['cpu_ms_summed_over_ranks']:13.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"seq_len": SEQ, "hidden": HIDDEN, "heads": HEADS,
                                              "repeats": args.repeats, "results": result}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
