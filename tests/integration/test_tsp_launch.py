"""tsp-launch as a user runs it (subprocesses): bad input is one line and exit 2 from the launcher's
own process, before Accelerate starts a rank; a good run goes through Accelerate's launcher (the
uninterrupted reference run of test_interrupt_launch.py, the same tsp-launch line); a rank's exit
code (75: stopped at a checkpoint) is the job's. `python -m tsp_trainer check` is the
same check alone (launch/torchrun.sh runs it)."""

import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.test_lifecycle_launch import SHORT, _env, _used_folder, recipe_launch_line

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# The console script once the package is installed; the same entry point through -m otherwise.
TSP_LAUNCH = ([str(BIN / "tsp-launch")] if (BIN / "tsp-launch").exists()
              else [sys.executable, "-m", "tsp_trainer", "launch"])


def _tsp_launch(recipe_args: list[str], **kwargs):
    """recipes/tiny_cpu.yaml's tsp-launch line as written, with `recipe_args` added."""
    written = shlex.split(recipe_launch_line("tiny_cpu.yaml", ("tsp-launch",)))
    return subprocess.run(TSP_LAUNCH + written[1:] + recipe_args, cwd=REPO, env=_env(),
                          capture_output=True, text=True, **kwargs)


@pytest.mark.parametrize("bad, says", [
    ("used", "already holds checkpoints of a run (latest step_00000040)"),
    ("train.stpes=3", "config key 'train.stpes' is not a known key (did you mean 'train.steps'?)"),
])
def test_bad_input_is_one_line_and_exit_2_before_any_rank(bad, says, tmp_path):
    arg = f"train.output_dir={_used_folder(tmp_path)}" if bad == "used" else bad
    t0 = time.monotonic()
    proc = _tsp_launch([arg], timeout=120)
    seconds = time.monotonic() - t0
    print(f"\ntsp-launch, bad input ({bad}): exit {proc.returncode} after {seconds:.1f} s")
    lines = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    # One line and nothing of torch elastic's (its banner, per-rank logs, ChildFailedError report):
    # no rank was started. (The time is printed, not asserted: it is the machine's load.)
    assert len(lines) == 1 and lines[0].startswith("tsp-launch: error: ") and says in lines[0], lines


@pytest.mark.slow
def test_a_ranks_exit_75_is_the_jobs_exit_code(tmp_path):
    """Every rank stops at a checkpoint (train.max_runtime_min) and exits 75: so does tsp-launch,
    with one line of its own instead of torch elastic's ChildFailedError report."""
    out = tmp_path / "run"
    proc = _tsp_launch(["train.steps=50", "train.max_runtime_min=0.001", f"train.output_dir={out}"]
                       + SHORT, timeout=600)
    assert proc.returncode == 75, proc.stderr[-4000:]
    assert "tsp-launch: exit code 75, rank " in proc.stderr
    assert "ChildFailedError" not in proc.stderr
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000001"


def test_check_command_passes_a_good_recipe_and_refuses_a_used_folder(tmp_path):
    check = [sys.executable, "-m", "tsp_trainer", "check", "--world-size", "4", "recipes/tiny_cpu.yaml"]
    # the three checks side by side (each its own process; none writes anything)
    good, bad, wrong_world = [
        subprocess.Popen(argv, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for argv in (check + [f"train.output_dir={tmp_path / 'new'}"],
                     check + [f"train.output_dir={_used_folder(tmp_path)}"], check[:5] + ["3"] + check[6:])]
    (good_out, good_err), (bad_out, bad_err), (_, wrong_err) = (p.communicate(timeout=120)
                                                                for p in (good, bad, wrong_world))
    assert good.returncode == 0, good_err
    assert good_out.strip() == (f"tsp-check: ok: recipes/tiny_cpu.yaml on 4 processes (dp 2 x tsp 2), "
                                f"output {tmp_path / 'new'}")
    assert bad.returncode == 2 and bad_out == ""
    assert bad_err.startswith("tsp-check: error: train.output_dir=") and bad_err.count("\n") == 1
    assert wrong_world.returncode == 2 and "world size 3" in wrong_err
