"""Workers never outlive their launcher: SIGKILL of torchrun (what the OOM killer or a node agent
does) mid-run stops every rank within seconds, without a new checkpoint, each saying so in one
line; the requeue with train.resume=auto continues from the last complete checkpoint with the
losses of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# A constant learning rate (min_lr = lr, one warmup step): the schedule does not depend on
# train.steps, so runs of 12 and of 400 steps train the same first steps.
RUN = ["data.seq_len=64", "optim.warmup_steps=1", "optim.min_lr=3.0e-3", "logging.progress_bar=false",
       "checkpoint.every=4", "train.eval_every=0", "train.resume=auto",
       "optim.on_resume_change=recipe"]     # the requeue's 12 steps, not the killed run's 400


def _env() -> dict:
    env = dict(os.environ, DS_ACCELERATOR="cpu", WANDB_MODE="disabled", NPROC="2",
               PYTHON=sys.executable, PYTHONPATH=str(REPO))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR"):
        env.pop(key, None)
    return env


def torchrun(out: Path, steps: int, **kw) -> subprocess.Popen:
    return subprocess.Popen(["bash", "launch/torchrun.sh", "recipes/tiny_cpu.yaml", f"train.steps={steps}",
                             f"train.output_dir={out}"] + RUN, cwd=REPO, env=_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def losses(out: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows}


def processes_naming(text: str) -> set[int]:
    """Live (not zombie) processes whose command line contains `text`."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if text in cmdline and state != "Z":
            found.add(int(entry.name))
    return found


@pytest.mark.slow
def test_sigkill_of_the_launcher_stops_every_rank_and_the_requeue_resumes(tmp_path):
    reference = tmp_path / "reference"
    ref = torchrun(reference, 12)
    _, stderr = ref.communicate(timeout=600)
    assert ref.returncode == 0, stderr[-3000:]

    out = tmp_path / "killed"
    launcher = torchrun(out, 400)
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + 600
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 9):
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
        time.sleep(0.05)
    ranks = processes_naming(f"train.output_dir={out} ") - {launcher.pid}
    assert len(ranks) >= 2, ranks                  # the two ranks (and any data workers they forked)
    os.kill(launcher.pid, signal.SIGKILL)
    t0 = time.monotonic()
    while processes_naming(f"train.output_dir={out} ") and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    seconds = time.monotonic() - t0
    left = processes_naming(f"train.output_dir={out} ")
    _, stderr = launcher.communicate(timeout=30)    # the ranks held the launcher's pipes
    before_requeue = losses(out)
    killed_at = max(before_requeue)
    latest = (out / "checkpoints" / "latest").read_text().strip()
    print(f"\nSIGKILL of the launcher after step {killed_at}: all {len(ranks)} rank processes gone "
          f"{seconds:.2f} s later; latest checkpoint {latest}")
    assert not left, f"still running {seconds:.1f} s after the launcher's SIGKILL: {left}"
    gone = f"tsp-train: the launcher (pid {launcher.pid}) is gone; stopping"
    assert stderr.count(gone) == 2, stderr[-3000:]
    assert "SIGTERM" not in stderr and "stopped after step" not in stderr   # no preemption save
    step = int(latest.split("_")[1])
    assert step % 4 == 0 and step <= killed_at, (latest, killed_at)
    assert not (out / "lease.json").exists()       # rank 0 released the folder on its way out

    again = torchrun(out, 12)
    _, stderr = again.communicate(timeout=600)
    assert again.returncode == 0, stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / latest} at step {step}" in stderr
    assert "stale lease" not in stderr
    expected = losses(reference)
    overlap = range(1, min(killed_at, 12) + 1)      # the killed run's steps up to 12
    assert {s: before_requeue[s] for s in overlap} == {s: expected[s] for s in overlap}
    assert losses(out) == expected                 # the requeue: steps 1-12, bit for bit
