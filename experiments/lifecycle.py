"""Measure the run-lifecycle figures docs/reliability.md quotes, and write them to
docs/results/reliability_timings.json. Usage (from the repository root, with the project's venv):

    .venv/bin/python experiments/lifecycle.py [--repeats 3] [--baseline-tree DIR]

- stall: 4 forked ranks (one TSP group), rank 2 SIGSTOPs itself in front of the MLP weight ring;
  the seconds each other rank waits before its CommError, for collective timeouts of 5 and 10 s.
- preempt: `accelerate launch` of recipes/tiny_cpu.yaml (4 ranks, no periodic checkpoints, seq
  64); SIGTERM to the launcher once step 3 is logged; seconds from the signal to the launcher's
  exit, the step logged at the signal, the checkpoint written, and steps lost (steps done before
  the signal that the checkpoint does not hold).
- input_error: seconds from `accelerate launch` to its exit for a data source that does not
  exist (4 ranks), for this tree and, with --baseline-tree, for another checkout of the project
  (e.g. `git archive main | tar -x -C DIR`), run interleaved so machine load hits both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SHORT = ["data.seq_len=64", "optim.warmup_steps=1", "logging.progress_bar=false"]


def _env():
    env = dict(os.environ, DS_ACCELERATOR="cpu", WANDB_MODE="disabled")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR", "PYTHONPATH"):
        env.pop(key, None)
    return env


def _launch(tree: Path, overrides: list[str], **popen):
    cmd = [str(BIN / "accelerate"), "launch", "--config_file", "launch/accelerate/cpu_4proc.yaml",
           "--main_process_port", "0", "-m", "tsp_trainer", "train", "recipes/tiny_cpu.yaml"] + overrides
    env = _env()
    env["PYTHONPATH"] = str(tree)              # -m tsp_trainer imports this tree's package
    return subprocess.Popen(cmd, cwd=tree, env=env, **popen)


# -- stall ------------------------------------------------------------------------------------------
def _stall_rank(rank, world, timeout_s):
    import torch

    from tsp_trainer.config import model_config
    from tsp_trainer.model import Transformer
    from tsp_trainer.parallel import zigzag
    from tsp_trainer.parallel.comm import CommError
    from tsp_trainer.parallel.mesh import build_mesh
    from tsp_trainer.parallel.schemes import parallelize

    cfg = model_config("tiny", num_heads=4, num_kv_heads=4)
    mesh = build_mesh(world, timeout_s=timeout_s)
    model = Transformer(cfg)
    model.init_weights(0)
    parallelize(model, "tsp", mesh, seq_len=16)
    ids = torch.zeros((1, 16), dtype=torch.long)
    x = model.embed_tokens(zigzag.shard_batch(ids, ids, rank, world)[0])
    if rank == 2:
        os.kill(os.getpid(), signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        model.layers[0].mlp(x)
    except CommError:
        waited = time.monotonic() - t0
        Path(os.environ["STALL_OUT"], f"{rank}.txt").write_text(str(waited))
        raise


def measure_stall(repeats: int, out_dir: Path) -> dict:
    from tsp_trainer.tools.launch import run_on_ranks

    results = {}
    for timeout_s in (5, 10):
        waits = []
        for i in range(repeats):
            folder = out_dir / f"stall_{timeout_s}_{i}"
            folder.mkdir(parents=True)
            os.environ["STALL_OUT"] = str(folder)
            try:
                run_on_ranks(_stall_rank, 4, timeout_s, timeout=120, pg_timeout_s=600)
            except RuntimeError:
                pass
            waits += [float(p.read_text()) for p in folder.glob("*.txt")]
        results[f"timeout_{timeout_s}s"] = {"waited_s": sorted(waits), "max_s": max(waits),
                                            "median_s": statistics.median(waits)}
    return results


# -- preemption -------------------------------------------------------------------------------------
def measure_preempt(repeats: int, out_dir: Path) -> list[dict]:
    runs = []
    for i in range(repeats):
        out = out_dir / f"preempt_{i}"
        proc = _launch(REPO, ["train.steps=500", "checkpoint.every=0", f"train.output_dir={out}"] + SHORT,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        metrics = out / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            if proc.poll() is not None:
                raise RuntimeError(proc.communicate()[1][-3000:])
            time.sleep(0.02)
        lines = metrics.read_text().splitlines()
        logged = json.loads(lines[-1])["step"]
        step_s = json.loads(lines[-1])["step_time_s"]
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=300)
        seconds = time.monotonic() - t0
        saved = int((out / "checkpoints" / "latest").read_text().strip().split("_")[1])
        runs.append({"logged_at_signal": logged, "checkpoint_step": saved, "steps_lost": max(0, logged - saved),
                     "signal_to_launcher_exit_s": round(seconds, 2), "step_time_s": round(step_s, 3),
                     "launcher_exit_code": proc.returncode})
    return runs


# -- input errors -----------------------------------------------------------------------------------
def measure_input_error(repeats: int, trees: dict[str, Path], out_dir: Path) -> dict:
    times: dict[str, list[float]] = {name: [] for name in trees}
    for i in range(repeats):
        for name, tree in trees.items():                  # interleaved: same load on both
            t0 = time.monotonic()
            proc = _launch(tree, ["data.source=/nonexistent/corpus", f"train.output_dir={out_dir / name / str(i)}"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            _, err = proc.communicate(timeout=600)
            times[name].append(round(time.monotonic() - t0, 1))
            assert "/nonexistent/corpus" in err, err[-2000:]
    return {name: {"seconds": t, "median_s": statistics.median(t)} for name, t in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline-tree", type=Path, default=None)
    parser.add_argument("--only", choices=("stall", "preempt", "input_error"), default=None)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "reliability_timings.json")
    args = parser.parse_args(argv)
    scratch = Path(os.environ.get("TMPDIR", "/tmp")) / f"tsp_lifecycle_{os.getpid()}"
    result = json.loads(args.out.read_text()) if args.out.exists() else {}
    load = os.getloadavg()
    result["machine"] = {"cpus": os.cpu_count(), "load_avg_at_start": [round(x, 1) for x in load]}
    if args.only in (None, "stall"):
        result["stall"] = measure_stall(args.repeats, scratch)
    if args.only in (None, "preempt"):
        result["preempt"] = measure_preempt(args.repeats, scratch)
    if args.only in (None, "input_error"):
        trees = {"this_tree": REPO}
        if args.baseline_tree:
            trees["baseline"] = args.baseline_tree
        result["input_error"] = measure_input_error(args.repeats, trees, scratch)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
