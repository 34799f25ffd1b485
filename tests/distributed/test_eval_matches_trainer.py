"""`tsp-eval loss` on a checkpoint, with its defaults (the run's micro-batch size, eval batches,
seq_len and held-out split) on the run's DP degree, reproduces the eval loss the trainer logged at
that step; on another DP degree it says why it cannot."""

import pytest

from tests.distributed.trainer_cases import captured_log, config
from tests.helpers.dist import run_on_ranks
from tsp_trainer.eval import cli as eval_cli

pytestmark = pytest.mark.distributed


def _train_with_eval(rank, world, overrides):
    from tsp_trainer.trainer import Trainer

    history = Trainer(config(overrides), world_size=world, global_rank=rank).fit()
    return history[-1].get("eval/loss")


def _eval_rank(rank, world, argv):
    job = eval_cli.prepare(eval_cli.build_parser().parse_args(argv), world_size=world, rank=rank)
    with captured_log():
        result = eval_cli.run(job, rank=rank)
    return {"loss": result.mean_loss, "warnings": list(job.warnings)}


def test_eval_loss_defaults_reproduce_the_trainers_number(tmp_path):
    out = tmp_path / "run"
    logged = run_on_ranks(_train_with_eval, 4, ["train.steps=2", "optim.warmup_steps=1", "train.eval_every=2",
                                                "train.eval_batches=3", f"train.output_dir={out}"])[0]
    evaluated = run_on_ranks(_eval_rank, 4, ["loss", str(out), "--tsp-degree", "2",
                                             "--out", str(tmp_path / "eval")])[0]
    assert evaluated["warnings"] == []
    assert evaluated["loss"] == pytest.approx(logged, rel=1e-6)
    other = run_on_ranks(_eval_rank, 1, ["loss", str(out), "--tsp-degree", "1",
                                         "--out", str(tmp_path / "eval2")])[0]
    assert any("the checkpoint's run evaluated on dp 2" in w for w in other["warnings"]), other
