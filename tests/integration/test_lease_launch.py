"""One job per output folder, through the real CLI: two `tsp-train` jobs started at the same moment
into one new folder (both with train.resume=auto, which alone would accept either): exactly one
trains, the other exits 2 before start-up with one line naming the holder. A lease held by
another live process is refused with one line naming it, and taken over once that process is
gone (the lease in one process: tests/unit/test_lease.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tsp_trainer.run.lease import LEASE_FILE, LeaseHeld, RunLease

REPO = Path(__file__).resolve().parents[2]


def _env() -> dict:
    env = dict(os.environ, DS_ACCELERATOR="cpu", WANDB_MODE="disabled", PYTHONPATH=str(REPO))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR", "SLURM_JOB_ID",
                "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    return env


@pytest.mark.slow           # two real launches (~6 s); the lease against a live holder stays below
def test_two_jobs_into_one_folder_at_once_one_runs_the_other_is_refused(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "tsp_trainer", "train", "recipes/tiny_cpu.yaml", "parallel.tsp_degree=1",
           "train.steps=30", "data.seq_len=64", "optim.warmup_steps=1", "logging.progress_bar=false",
           "train.eval_every=0", "train.resume=auto", f"train.output_dir={out}"]
    t0 = time.monotonic()
    jobs = [subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for _ in range(2)]
    ended = {}
    results = {}
    while len(ended) < 2:
        for job in jobs:
            if job.pid not in ended and job.poll() is not None:
                ended[job.pid] = time.monotonic() - t0
        assert time.monotonic() - t0 < 500, "the jobs did not end"
        time.sleep(0.05)
    for job in jobs:
        results[job.pid] = (job.returncode, *job.communicate())
    codes = sorted(code for code, _, _ in results.values())
    assert codes == [0, 2], {pid: (code, err[-2000:]) for pid, (code, _, err) in results.items()}
    winner = next(pid for pid, r in results.items() if r[0] == 0)
    loser = next(pid for pid, r in results.items() if r[0] == 2)
    _, stdout, stderr = results[loser]
    print(f"\nthe second job was refused {ended[loser]:.1f} s after both started (the first ran "
          f"{ended[winner]:.1f} s)")
    assert stdout == "" and ended[loser] < ended[winner]
    errors = [x for x in stderr.splitlines() if x.startswith("tsp-train: error:")]
    assert len(errors) == 1, stderr
    assert errors[0].startswith(f"tsp-train: error: train.output_dir={str(out)!r} is in use by another "
                                f"job (host {socket.gethostname()}, pid {winner}, no job id, since 20"), errors
    assert f"{out / 'lease.json'}): one job per output folder" in errors[0]
    assert "Traceback" not in stderr and "DeepSpeed" not in stderr
    _, stdout, _ = results[winner]
    assert "tsp-train: done: 30 steps" in stdout
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 31))              # one job's metrics, each step once
    assert not (out / "lease.json").exists()        # released at the winner's exit


def acquire(out, warnings=None):
    return RunLease.acquire(out, warn=(warnings if warnings is not None else []).append, heartbeat_s=0)


def test_a_live_holder_in_another_process_is_refused_with_one_line_naming_it(tmp_path):
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom tsp_trainer.run.lease import RunLease\n"
         f"RunLease.acquire({str(out)!r}, warn=print)\nprint('held', flush=True)\ntime.sleep(60)"],
        cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO), SLURM_JOB_ID="777"),
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(LeaseHeld) as err:
            acquire(out)
        line = str(err.value)
        assert "\n" not in line
        assert line.startswith(f"train.output_dir={str(out)!r} is in use by another job (host {socket.gethostname()}, "
                               f"pid {holder.pid}, job 777, since 20"), line
        assert str(out / LEASE_FILE) in line
    finally:
        holder.kill()
        holder.wait()
    # The kernel dropped the dead holder's lock: the folder is taken over, with one warning.
    warnings = []
    lease = acquire(out, warnings)
    assert len(warnings) == 1 and f"pid {holder.pid}" in warnings[0], warnings
    assert "taking over the stale lease" in warnings[0] and "its process is gone" in warnings[0]
    assert json.loads((out / LEASE_FILE).read_text())["pid"] == os.getpid()
    lease.release()
