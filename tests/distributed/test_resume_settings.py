"""optim.on_resume_change through the whole Trainer (one process): a resume whose optimizer or
schedule settings differ from the checkpoint's is refused unless the setting names the side that
wins; `recipe` runs the recipe's schedule from the resumed step, `checkpoint` the saved one."""

import os
import subprocess
import sys

import pytest

from tests.distributed.trainer_cases import RECIPE, REPO, FAST, config
from tests.helpers.dist import run_on_ranks
from tsp_trainer.optim import Schedule

pytestmark = pytest.mark.distributed

STEPS, LR, MIN_LR, WARMUP = 6, 3e-3, 3e-4, 2          # FAST's lr and warm-up, the recipe's min_lr
ONE = ["parallel.tsp_degree=1"]


def _lr_rank(rank, world, overrides):
    from tsp_trainer.trainer import Trainer

    trainer = Trainer(config(ONE + overrides), world_size=world, global_rank=rank)
    history = trainer.fit()
    group = trainer.optimizer.param_groups[0]
    return {"lrs": [h["train/lr"] for h in history], "betas": tuple(group["betas"]),
            "weight_decay": group["weight_decay"]}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 6-step run saving every 3 steps: its checkpoints folder and its rates."""
    out = tmp_path_factory.mktemp("resume_settings") / "a"
    run = run_on_ranks(_lr_rank, 1, [f"train.steps={STEPS}", "checkpoint.every=3",
                                     f"train.output_dir={out}"])[0]
    return out / "checkpoints", run["lrs"]


def _resume(saved, tmp_path, step: int, extra: list[str]):
    ckpt, _ = saved
    return run_on_ranks(_lr_rank, 1, [f"train.resume={ckpt / f'step_{step:08d}'}",
                                      f"train.output_dir={tmp_path}"] + extra)[0]


def test_lower_lr_is_honoured_under_recipe(saved, tmp_path):
    """Steps 4-6 after a resume at step 3 with a 30x lower lr run the recipe's schedule at steps
    3-5, not the checkpoint's peak times the recipe's shape."""
    _, full = saved
    resumed = _resume(saved, tmp_path, 3, [f"train.steps={STEPS}", "optim.lr=1e-4", "optim.min_lr=1e-5",
                                           "optim.on_resume_change=recipe", "optim.weight_decay=0.05"])
    recipe = Schedule(1e-4, 1e-5, WARMUP, STEPS)
    assert resumed["lrs"] == pytest.approx([recipe.lr_at(s) for s in range(3, STEPS)], rel=1e-12)
    assert max(resumed["lrs"]) < 1e-4 < min(full[3:]) / 5
    assert resumed["weight_decay"] == 0.05


@pytest.mark.parametrize("policy", ["recipe", "checkpoint"])
def test_extending_train_steps(saved, tmp_path, policy):
    """The final step-6 checkpoint resumed to 8 steps: `recipe` runs the 8-step schedule from step 6
    (its rate at steps 7 and 8), `checkpoint` keeps the 6-step one (past its end: min_lr), and the
    saved betas and weight decay stay under `checkpoint` only."""
    _, full = saved
    resumed = _resume(saved, tmp_path, STEPS, ["train.steps=8", f"optim.on_resume_change={policy}",
                                               "optim.beta2=0.99"])
    wins = Schedule(LR, MIN_LR, WARMUP, 8 if policy == "recipe" else STEPS)
    assert resumed["lrs"] == pytest.approx([wins.lr_at(6), wins.lr_at(7)], rel=1e-12)
    if policy == "checkpoint":
        assert resumed["lrs"] == pytest.approx([MIN_LR, MIN_LR], rel=1e-12)
        assert resumed["betas"] == (0.9, 0.95)
    else:
        assert resumed["lrs"][0] > full[-1] > MIN_LR      # the 8-step cosine is back above step 6
        assert resumed["betas"] == (0.9, 0.99)


def test_unchanged_settings_need_no_choice(saved, tmp_path):
    """The same settings resume as they always did: the saved rates, no choice asked for."""
    _, full = saved
    resumed = _resume(saved, tmp_path, 3, [f"train.steps={STEPS}"])
    assert resumed["lrs"] == full[3:]


def test_a_change_without_a_choice_exits_2_naming_each_difference(saved, tmp_path):
    """`check` (tsp-train's input checks alone) refuses before any start-up: exit 2, one line
    with each key, the checkpoint's value and the recipe's, and the setting that decides."""
    ckpt, _ = saved
    args = [sys.executable, "-m", "tsp_trainer", "check", RECIPE, *FAST, *ONE, f"train.steps={STEPS + 2}",
            "optim.lr=1e-4", "optim.min_lr=1e-5", f"train.resume={ckpt / 'step_00000003'}",
            f"train.output_dir={tmp_path / 'b'}"]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=180)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    for part in ("optim.lr 0.003 in the checkpoint, 0.0001 in the recipe",
                 "optim.min_lr 0.0003 in the checkpoint, 1e-05 in the recipe",
                 "train.steps 6 in the checkpoint, 8 in the recipe",
                 "optim.on_resume_change=recipe", "optim.on_resume_change=checkpoint"):
        assert part in line, line
    assert "optim.beta" not in line and "weight_decay" not in line
    assert not (tmp_path / "b").exists()          # refused before the run folder was made
