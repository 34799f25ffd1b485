"""experiments/longest_cpu.py at a tiny length: its recipe trained through the Trainer on 2 gloo
ranks (TSP D=2, document masking, checkpointing and offload on) with the loss and MLP tiled into
several chunks, and again with the script's untiled overrides, gives the same losses step for step
within the script's tolerance; and the script's plan finds the length where the planned peak meets
the budget."""

import pytest

from tests.distributed.trainer_cases import captured_log
from tests.helpers.dist import run_on_ranks
from tests.helpers.experiments import load_experiment

pytestmark = pytest.mark.distributed

SEQ_LEN = 512                        # 256 local tokens a rank on D=2
CHUNK = ["parallel.loss_chunk_tokens=48", "parallel.mlp_chunk_tokens=40"]   # 6 and 7 chunks, short last


def _losses(rank, world, out, overrides):
    from tsp_trainer.trainer import Trainer

    script = load_experiment("longest_cpu")
    cfg = script.recipe_config(SEQ_LEN, ["parallel.tsp_degree=2", "train.steps=3", "checkpoint.enabled=false",
                                         "logging.progress_bar=false", f"train.output_dir={out}", *overrides])
    with captured_log():
        trainer = Trainer(cfg, world_size=world, global_rank=rank)
        losses = [h["train/loss"] for h in trainer.fit()]
    return {"losses": losses, "offload": cfg.train.offload_activations,
            "chunks": (cfg.parallel.loss_chunk_tokens, cfg.parallel.mlp_chunk_tokens)}


def test_tiled_run_of_the_recipe_has_the_untiled_losses(tmp_path):
    script = load_experiment("longest_cpu")
    # one launch per run: a process builds one Accelerator (with its DeepSpeed plugin)
    tiled = run_on_ranks(_losses, 2, str(tmp_path / "tiled"), CHUNK)
    untiled = run_on_ranks(_losses, 2, str(tmp_path / "untiled"), script.untiled_overrides(SEQ_LEN))
    assert (tiled[0]["offload"], tiled[0]["chunks"]) == (True, (48, 40))
    assert (untiled[0]["offload"], untiled[0]["chunks"]) == (False, (SEQ_LEN, SEQ_LEN))
    losses = tiled[0]["losses"]
    assert len(losses) == 3 and losses[0] > losses[2]            # it trains: the loss falls
    rel = script.relative_differences(losses, untiled[0]["losses"])
    assert max(rel) <= script.LOSS_RTOL, (losses, untiled[0]["losses"])
    assert tiled[1]["losses"] == losses                          # every rank reports the same loss


def test_the_plan_is_the_longest_length_the_budget_holds():
    script = load_experiment("longest_cpu")
    budget = script.rank_budget_bytes()
    assert budget == pytest.approx(5.5 * 2 ** 30)                # 22 GiB usable over 4 ranks
    n = script.longest_fitting(lambda s: script.planned_rank_bytes(s)["total"] <= budget)
    assert n % script.GRANULE == 0
    assert script.planned_rank_bytes(n)["total"] <= budget
    assert script.planned_rank_bytes(n + script.GRANULE)["total"] > budget
    # the planner's bytes grow with the length: ~1.4 KB a token of the whole sequence per rank
    at = script.planned_rank_bytes(n)
    assert 1000 < at["planner"] / n < 2000


def test_longest_fitting_bisects_to_the_last_granule_that_fits():
    script = load_experiment("longest_cpu")
    assert script.longest_fitting(lambda s: s <= 5000, granule=1024) == 4096
    assert script.longest_fitting(lambda s: s <= 1 << 20, granule=1024) == 1 << 20
    assert script.longest_fitting(lambda s: False, granule=1024) == 0
