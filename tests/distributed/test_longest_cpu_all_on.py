"""experiments/longest_cpu.py --all-on at a tiny length: its recipe with every memory technique on
(loss and MLP tiled, checkpointing nested two blocks a segment, the replay keeping nothing, K/V
gathered in chunks, the block input offloaded) trains through the Trainer on 2 gloo ranks with the
plain run's losses (tiling, nesting, the replay and the offload off, attention unchunked) within
the script's tolerance; and its plan finds the longest length a stated budget holds."""

import pytest

from tests.distributed.trainer_cases import captured_log
from tests.helpers.dist import run_on_ranks
from tests.helpers.experiments import load_experiment

pytestmark = pytest.mark.distributed

SEQ_LEN = 256                        # 128 local tokens a rank on D=2
SMALL = ["parallel.loss_chunk_tokens=48", "parallel.mlp_chunk_tokens=40",
         "parallel.attention_chunk_tokens=48"]            # 3 or 4 chunks a rank, short last ones
PLAIN = ["train.checkpoint_segment_blocks=1", "parallel.checkpoint_replay_keeps=all",
         "parallel.attention_chunk_tokens=auto"]


def _run(rank, world, out, overrides):
    from tsp_trainer.trainer import Trainer

    script = load_experiment("longest_cpu")
    cfg = script.recipe_config(SEQ_LEN, ["parallel.tsp_degree=2", "train.steps=2", "checkpoint.enabled=false",
                                         "logging.progress_bar=false", f"train.output_dir={out}", *overrides])
    with captured_log():
        trainer = Trainer(cfg, world_size=world, global_rank=rank)
        losses = [h["train/loss"] for h in trainer.fit()]
    c = trainer.cfg
    return {"losses": losses, "settings": (c.train.offload_activations, c.train.checkpoint_segment_blocks,
                                           c.parallel.checkpoint_replay_keeps, c.parallel.attention_chunk_tokens)}


def test_everything_on_has_the_plain_losses(tmp_path):
    script = load_experiment("longest_cpu")
    on = run_on_ranks(_run, 2, str(tmp_path / "on"), [*script.ALL_ON, *SMALL])
    plain = run_on_ranks(_run, 2, str(tmp_path / "plain"), script.untiled_overrides(SEQ_LEN) + PLAIN)
    assert on[0]["settings"] == (True, 2, "nothing", 48)
    assert plain[0]["settings"] == (False, 1, "all", "auto")
    losses = on[0]["losses"]
    assert len(losses) == 2 and losses[0] > losses[1] and on[1]["losses"] == losses
    assert max(script.relative_differences(losses, plain[0]["losses"])) <= script.LOSS_RTOL, (
        losses, plain[0]["losses"])


def test_the_all_on_plan_is_the_longest_length_the_stated_budget_holds():
    script = load_experiment("longest_cpu")
    budget = script.ALL_ON_RANK_BUDGET_GIB * 2 ** 30
    n = script.longest_all_on(budget)
    assert n % script.GRANULE == 0
    assert script.planned_rank_bytes(n, "all_on")["total"] <= budget
    assert script.planned_rank_bytes(n + script.GRANULE, "all_on")["total"] > budget
    # the techniques lower the planned rank peak at that length
    assert script.planned_rank_bytes(n, "all_on")["planner"] < script.planned_rank_bytes(n, "tiled")["planner"]
