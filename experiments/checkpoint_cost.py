"""Checkpoint cost on the training loop, measured with the real Trainer on CPU.

    python experiments/checkpoint_cost.py stall [--size 125m] [--rounds 2] [--set model.num_layers=4 ...]
    python experiments/checkpoint_cost.py bytes [--size 125m] [--world 4 --tsp 2] [--out docs/results/checkpoint_cost.json]

stall: runs of 5 steps with a checkpoint every 2 steps (saves at steps 2 and 4; the final one at
step 5 is reported apart, since nothing is left to overlap with it), interleaved round by round:
checkpoint.async_save=false, =true, and no checkpoints. Per periodic save it records the time the
training thread was blocked in CheckpointWriter.save / poll / wait until that save was published (the
stall), and per run the loop's wall time; "overhead" is a run's wall time minus the interleaved
run without checkpoints, divided by its saves.

bytes: one short run, then the bytes of the last checkpoint's files against the bytes of the
training state (weights + fp32 master when not fp32 + the two AdamW moments, each distinct shard
once). Runs against whatever tsp_trainer is importable (PYTHONPATH=/path/to/older/checkout to
measure an older format).

Numbers from a shared 2-core machine are noisy: compare the rows of one run, not across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

STEPS, EVERY = 5, 2


def _overrides(size: str, out: str, extra: list[str]) -> list[str]:
    return [f"model.size={size}", "parallel.tsp_degree=1", "data.seq_len=64", "data.micro_batch_size=1",
            f"data.source={REPO / 'data' / 'corpus'}", f"data.tokenizer={REPO / 'data' / 'tokenizer'}",
            "train.eval_every=0", "logging.progress_bar=false", "logging.jsonl=false",
            f"train.steps={STEPS}", f"checkpoint.every={EVERY}", "checkpoint.keep_last=1",
            f"train.output_dir={out}", "optim.warmup_steps=1"] + extra


def _timed_run(rank, world, overrides):
    """One fit; the blocked time of every CheckpointWriter call, tagged with the step it ran at."""
    from tsp_trainer.config import load_config
    from tsp_trainer.trainer import Trainer

    trainer = Trainer(load_config(REPO / "recipes" / "tiny_cpu.yaml", overrides), world_size=world,
                      global_rank=rank)
    calls = []
    ckpt = trainer.checkpoints.writer
    for name in ("save", "poll", "wait"):
        real = getattr(ckpt, name)

        def timed(*args, _real=real, _name=name, **kwargs):
            start = time.perf_counter()
            try:
                return _real(*args, **kwargs)
            finally:
                calls.append((_name, trainer.state.step, time.perf_counter() - start,
                              ckpt.in_flight))
        setattr(ckpt, name, timed)
    start = time.perf_counter()
    trainer.fit()
    return {"wall_s": time.perf_counter() - start, "calls": calls, "state_bytes": _state_bytes(trainer)}


def _state_bytes(trainer) -> int:
    """Distinct training state: weights + two fp32 moments (+ fp32 master when not fp32), each
    model-parallel shard once (replicated tensors once), summed over one replica."""
    mine = 0
    for name, p in trainer.par.model.named_parameters():
        if trainer.par.specs[name].dim is None and trainer.mesh.tsp_rank != 0:
            continue
        mine += p.numel() * (p.element_size() + 8 + (4 if p.dtype.itemsize != 4 else 0))
    return sum(trainer.mesh.tsp.all_gather_object(mine))


def _per_save_stalls(calls) -> tuple[list[float], float]:
    """(stall of each periodic save, stall of the final save). A save's stall: its save() call
    plus every poll()/wait() after it up to (and including) the one that published it."""
    saves, current, final = [], None, 0.0
    for name, step, seconds, in_flight in calls:
        if name == "save":
            current = [step, seconds]
            saves.append(current)
        elif current is not None:
            current[1] += seconds
        if current is not None and not in_flight:
            current = None
    periodic = [s for step, s in saves if step < STEPS]
    final = sum(s for step, s in saves if step == STEPS)
    return periodic, final


def stall(args) -> dict:
    from tsp_trainer.tools.launch import run_on_ranks

    modes = {"sync": ["checkpoint.async_save=false"], "async": ["checkpoint.async_save=true"],
             "none": ["checkpoint.enabled=false"]}
    rows = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        for round_ in range(args.rounds):
            for mode, extra in modes.items():
                out = os.path.join(tmp, f"{mode}{round_}")
                result = run_on_ranks(_timed_run, 1, _overrides(args.size, out, extra + args.set),
                                      threads=2)[0]
                periodic, final = _per_save_stalls(result["calls"])
                rows[mode].append({"wall_s": result["wall_s"], "stall_per_save_s": periodic,
                                   "final_save_s": final, "state_bytes": result["state_bytes"]})
                print(f"round {round_} {mode:5s}: loop {result['wall_s']:.2f} s, stalls per save "
                      f"{[round(s, 3) for s in periodic]}, final save {final:.2f} s", flush=True)
    summary = {}
    for mode in ("sync", "async"):
        stalls = [s for r in rows[mode] for s in r["stall_per_save_s"]]
        overhead = [(r["wall_s"] - n["wall_s"]) / (STEPS // EVERY) for r, n in zip(rows[mode], rows["none"])]
        summary[mode] = {"mean_stall_per_save_s": sum(stalls) / len(stalls),
                         "mean_loop_overhead_per_save_s": sum(overhead) / len(overhead)}
    summary["async_over_sync_stall"] = (summary["async"]["mean_stall_per_save_s"]
                                        / summary["sync"]["mean_stall_per_save_s"])
    summary["async_over_sync_overhead"] = (summary["async"]["mean_loop_overhead_per_save_s"]
                                           / summary["sync"]["mean_loop_overhead_per_save_s"])
    return {"mode": "stall", "size": args.size, "overrides": args.set, "steps": STEPS, "every": EVERY,
            "rounds": rows,
            "summary": summary, "state_gib": rows["sync"][0]["state_bytes"] / 2**30}


def _bytes_run(rank, world, overrides):
    from tsp_trainer.config import load_config
    from tsp_trainer.trainer import Trainer

    cfg = load_config(REPO / "recipes" / "tiny_cpu.yaml", overrides)
    trainer = Trainer(cfg, world_size=world, global_rank=rank)
    trainer.fit()
    return _state_bytes(trainer)


def bytes_(args) -> dict:
    from tsp_trainer.tools.launch import run_on_ranks

    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        extra = [f"parallel.tsp_degree={args.tsp}", "train.steps=2", "checkpoint.every=0"] + args.set
        overrides = _overrides(args.size, tmp, []) + extra
        state = run_on_ranks(_bytes_run, args.world, overrides)[0]
        step = Path(tmp) / "checkpoints" / "step_00000002"
        files = {str(p.relative_to(step)): p.stat().st_size for p in step.rglob("*") if p.is_file()}
    by_folder = {}
    for rel, size in files.items():
        top = rel.split("/", 1)[0] if "/" in rel else rel
        by_folder[top] = by_folder.get(top, 0) + size
    total = sum(files.values())
    print(f"state {state / 2**20:.1f} MiB, checkpoint {total / 2**20:.1f} MiB, ratio {total / state:.3f}; "
          + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(by_folder.items())))
    return {"mode": "bytes", "size": args.size, "overrides": args.set, "world": args.world, "tsp": args.tsp,
            "state_bytes": state, "checkpoint_bytes": total, "ratio": total / state,
            "by_folder": by_folder}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["stall", "bytes"])
    parser.add_argument("--size", default="125m", help="model.size (125m: ~1.5 GB of state)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--tsp", type=int, default=1)
    parser.add_argument("--set", nargs="*", default=[], help="more dotlist overrides")
    parser.add_argument("--tmp", default=None, help="where checkpoints are written (default: $TMPDIR)")
    parser.add_argument("--out", help="append the result as JSON to this file")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("WANDB_MODE", "disabled")
    result = stall(args) if args.mode == "stall" else bytes_(args)
    print(json.dumps(result.get("summary", {k: v for k, v in result.items() if k != "by_folder"}), indent=1))
    if args.out:
        path = Path(args.out)
        docs = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps(docs + [result], indent=1) + "\n")


if __name__ == "__main__":
    main()
