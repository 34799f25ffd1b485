"""The README's main job, end to end: `accelerate launch` with the shipped CPU config runs
recipes/tiny_cpu.yaml (4 processes, DP=2 x TSP=2) and the loss falls; `launch/torchrun.sh` runs
a short variant. Subprocesses, like a user would run them."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _env():
    env = dict(os.environ, DS_ACCELERATOR="cpu", WANDB_MODE="disabled")
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)
    return env


def test_accelerate_launch_tiny_cpu_recipe(tmp_path):
    """The plain `accelerate launch` line of recipes/tiny_cpu.yaml's comment, as written."""
    from tests.integration.test_lifecycle_launch import recipe_launch_line

    out = tmp_path / "tiny"
    written = shlex.split(recipe_launch_line("tiny_cpu.yaml", ("accelerate launch",)))
    cmd = [str(BIN / "accelerate")] + written[1:] + [f"train.output_dir={out}", "logging.progress_bar=false"]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, 61))
    first, last = lines[0]["train/loss"], sum(m["train/loss"] for m in lines[-5:]) / 5
    assert last < first - 0.8, (first, last)              # measured 6.93 -> ~5.6
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000060"
    assert (out / "config.yaml").exists()
    assert "tsp-train: done: 60 steps" in proc.stdout


def test_torchrun_script_and_bad_recipe_message(tmp_path):
    env = dict(_env(), NPROC="2", MASTER_PORT="0", PYTHON=sys.executable)
    proc = subprocess.run(["bash", "launch/torchrun.sh", "recipes/tiny_cpu.yaml", "train.steps=6",
                           "optim.warmup_steps=2", "data.seq_len=64", "checkpoint.every=0",
                           "train.eval_every=0", f"train.output_dir={tmp_path / 'tr'}",
                           "logging.progress_bar=false"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "tsp-train: done: 6 steps" in proc.stdout
    bad = subprocess.run([str(BIN / "tsp-train"), "recipes/tiny_cpu.yaml", "train.stpes=3"],
                         cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert "train.stpes" in bad.stderr and "train.steps" in bad.stderr
    assert not (REPO / "runs" / "default").exists()


@pytest.mark.parametrize("path", ["launch/slurm_7b_128k_1024gpu.sbatch", "launch/torchrun.sh"])
def test_launch_scripts_parse(path):
    assert subprocess.run(["bash", "-n", path], cwd=REPO).returncode == 0
