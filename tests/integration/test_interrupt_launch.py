"""Ctrl-C as a terminal sends it: SIGINT to tsp-launch's whole process group (the launcher and
every rank) mid-run. Every rank saves the step it reached and exits 130 with no traceback, the
launcher says what the ranks did, and train.resume=auto continues from that checkpoint exactly.
The uninterrupted reference run is also test_tsp_launch.py's good run through Accelerate's
launcher."""

import json
import os
import shlex
import signal
import subprocess
import time

from tests.integration.test_lifecycle_launch import SHORT, _env, recipe_launch_line
from tests.integration.test_orphans import losses
from tests.integration.test_tsp_launch import REPO, TSP_LAUNCH

# A flat rate after one warm-up step: runs of 12 and of 200 steps train the same first steps.
RUN = SHORT + ["optim.min_lr=3.0e-3", "checkpoint.every=0", "train.eval_every=0"]


def _launch(args: list[str], **kwargs):
    written = shlex.split(recipe_launch_line("tiny_cpu.yaml", ("tsp-launch",)))
    return TSP_LAUNCH + written[1:] + RUN + args, dict(cwd=REPO, env=_env(), text=True, **kwargs)


def test_ctrl_c_to_the_process_group_checkpoints_the_step_and_resume_is_exact(tmp_path):
    command, options = _launch(["train.steps=12", f"train.output_dir={tmp_path / 'reference'}"])
    reference = subprocess.run(command, capture_output=True, timeout=600, **options)
    # a good run through recipes/tiny_cpu.yaml's tsp-launch line: done, its last step saved
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert "tsp-train: done: 12 steps" in reference.stdout
    assert (tmp_path / "reference" / "checkpoints" / "latest").read_text().strip() == "step_00000012"

    out = tmp_path / "run"
    command, options = _launch(["train.steps=200", f"train.output_dir={out}"])
    # its own session and process group, as a terminal's foreground job
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, **options)
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + 400
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    k = json.loads(metrics.read_text().splitlines()[-1])["step"]
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    latest = (out / "checkpoints" / "latest").read_text().strip()
    step = int(latest.split("_")[1])
    print(f"\nCtrl-C after step {k} was logged: checkpoint {latest}, exit code {proc.returncode}")
    assert proc.returncode == 130, stderr[-3000:]
    assert step in (k, k + 1, k + 2) and step <= 10, (k, latest)
    assert max(losses(out)) == step                 # the checkpoint is of the last step run
    summary = [line for line in stdout.splitlines() if line.startswith("tsp-train: stopped")]
    assert summary == [f"tsp-train: stopped after step {step} of 200 (signal SIGINT); checkpoints in "
                       f"{out}/checkpoints; relaunch with train.resume=auto to continue (exit code 130)"]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    assert "closing signal" not in stderr and "death signal" not in stderr     # torch elastic's lines
    assert "tsp-launch: stopped by SIGINT; the ranks were sent it too: each saves a checkpoint" in stderr

    command, options = _launch(["train.steps=12", f"train.output_dir={out}", "train.resume=auto",
                                "optim.on_resume_change=recipe"])
    again = subprocess.run(command, capture_output=True, timeout=600, **options)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / latest} at step {step}" in again.stderr
    assert losses(out) == losses(tmp_path / "reference")        # steps 1-12, bit for bit
