"""A run stopped twice through the real launchers (subprocesses, 4 ranks), as a user meets it, and
resumed with train.resume=auto into the same folder, beside an uninterrupted run of the same
recipe that saves every step (the reference; also the good run of recipes/tiny_cpu.yaml's
tsp-launch line through Accelerate's launcher):

1. SIGTERM to `accelerate launch` (recipes/tiny_cpu.yaml's plain line as written) once step 3 is
   logged, as a preempted job: torch elastic forwards it to the ranks, which agree, checkpoint
   the step they reached and exit 75; the launcher exits non-zero with its own SignalException
   traceback (documented), within seconds.
2. The relaunch through `tsp-launch` resumes that checkpoint; Ctrl-C as a terminal sends it
   (SIGINT to tsp-launch's whole process group: the launcher and every rank) once 3 more steps
   are logged. Every rank saves the step it reached and exits 130 with no traceback, and the
   launcher says what the ranks did.

Each stop's checkpoint holds the reference's weights and optimizer state of that step, byte for
byte, and metrics.jsonl holds each step once with the reference's losses bit for bit: the steps
after the resume are the uninterrupted run's, and a resume from the Ctrl-C checkpoint starts from
the same state. Both launches log to one W&B run (offline: one run id).

A flat rate after one warm-up step: runs of 16 and of 200 steps train the same first steps."""

import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.test_lifecycle_launch import SHORT, _accelerate, _env, recipe_launch_line
from tests.integration.test_orphans import losses
from tests.integration.test_tsp_launch import REPO, TSP_LAUNCH

RUN = SHORT + ["optim.min_lr=3.0e-3", "train.eval_every=0"]
STEPS = 16
ENV = _env(WANDB_MODE="offline", WANDB_SILENT="true")

# three 4-rank launches in a row (~50 s): the slow tier; the default suite's twin is
# tests/distributed/test_preemption.py (a signal on one rank, the checkpoint and the exact resume)
pytestmark = pytest.mark.slow


def _tsp_launch(args: list[str]) -> list[str]:
    written = shlex.split(recipe_launch_line("tiny_cpu.yaml", ("tsp-launch",)))
    return TSP_LAUNCH + written[1:] + RUN + args


def _stop_once_logged(command: list[str], out: Path, steps: int, stop) -> tuple:
    """Starts `command` in a session of its own (a terminal's foreground job), calls stop(proc)
    once metrics.jsonl holds `steps` lines; returns (proc, stdout, stderr, last logged step at the
    signal, seconds from the signal to the launcher's exit, the checkpointed step)."""
    proc = subprocess.Popen(command, cwd=REPO, env=ENV, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + 400
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    k = json.loads(metrics.read_text().splitlines()[-1])["step"]
    t0 = time.monotonic()
    stop(proc)
    stdout, stderr = proc.communicate(timeout=120)
    seconds = time.monotonic() - t0
    step = int((out / "checkpoints" / "latest").read_text().strip().split("_")[1])
    return proc, stdout, stderr, k, seconds, step


def _state_hashes(checkpoints: Path, step: int) -> dict[str, str]:
    """sha256 of every model and optimizer shard of a checkpoint (its manifest's)."""
    manifest = json.loads((checkpoints / f"step_{step:08d}" / "manifest.json").read_text())
    files = manifest["files"]
    hashes = {name: entry["sha256"] for name, entry in files.items() if name.startswith(("model/", "optim/"))}
    assert hashes, manifest
    return hashes


def test_sigterm_then_ctrl_c_checkpoint_the_reference_runs_state_and_resume_is_exact(tmp_path):
    reference = tmp_path / "reference"
    done = subprocess.run(_tsp_launch([f"train.steps={STEPS}", f"train.output_dir={reference}",
                                       "checkpoint.every=1", f"checkpoint.keep_last={STEPS}"]),
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    # a good run through recipes/tiny_cpu.yaml's tsp-launch line: done, every step saved, learning
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"tsp-train: done: {STEPS} steps" in done.stdout
    assert (reference / "checkpoints" / "latest").read_text().strip() == f"step_{STEPS:08d}"
    expected = losses(reference)
    assert sum(expected[s] for s in range(STEPS - 2, STEPS + 1)) / 3 < expected[1] - 0.5, expected

    out = tmp_path / "run"
    folder = [f"train.output_dir={out}", "train.resume=auto", "train.steps=200", "checkpoint.every=0",
              "logging.wandb_mode=offline"]
    # 1. SIGTERM to the launcher (not its group): torch elastic forwards it to the ranks
    proc, stdout, stderr, k, seconds, first = _stop_once_logged(
        _accelerate(RUN + folder), out, 3, lambda p: p.send_signal(signal.SIGTERM))
    print(f"\nSIGTERM to the launcher after step {k} was logged: checkpoint of step {first}, launcher "
          f"exited {seconds:.2f} s after the signal with code {proc.returncode}")
    assert first in (k, k + 1, k + 2), (k, first)              # the step in flight, or the next
    assert proc.returncode != 0 and seconds < 60, (proc.returncode, seconds)
    assert f"tsp-train: stopped after step {first} of 200 (signal SIGTERM)" in stdout, stdout
    assert "exit code 75" in stdout and "SignalException" in stderr
    assert losses(out) == {s: expected[s] for s in range(1, first + 1)}   # the last step run is saved
    assert _state_hashes(out / "checkpoints", first) == _state_hashes(reference / "checkpoints", first)
    run_id = json.loads((out / "run.json").read_text())["wandb_run_id"]

    # 2. resumed through tsp-launch; Ctrl-C: SIGINT to its process group, 3 steps later
    proc, stdout, stderr, k, _, second = _stop_once_logged(
        _tsp_launch(folder), out, first + 3, lambda p: os.killpg(p.pid, signal.SIGINT))
    print(f"Ctrl-C after step {k} was logged: checkpoint of step {second}, exit code {proc.returncode}")
    assert proc.returncode == 130, stderr[-3000:]
    assert f"resumed from {out / 'checkpoints'}/step_{first:08d} at step {first}" in stderr
    assert second in (k, k + 1, k + 2) and second <= STEPS, (k, second)
    summary = [line for line in stdout.splitlines() if line.startswith("tsp-train: stopped")]
    assert summary == [f"tsp-train: stopped after step {second} of 200 (signal SIGINT); checkpoints in "
                       f"{out}/checkpoints; relaunch with train.resume=auto to continue (exit code 130)"]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    assert "closing signal" not in stderr and "death signal" not in stderr     # torch elastic's lines
    assert "tsp-launch: stopped by SIGINT; the ranks were sent it too: each saves a checkpoint" in stderr
    # each step once, the resumed steps the uninterrupted run's bit for bit
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == \
        list(range(1, second + 1))
    assert losses(out) == {s: expected[s] for s in range(1, second + 1)}
    assert _state_hashes(out / "checkpoints", second) == _state_hashes(reference / "checkpoints", second)
    assert json.loads((out / "run.json").read_text())["wandb_run_id"] == run_id
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(run_id) for r in runs)
