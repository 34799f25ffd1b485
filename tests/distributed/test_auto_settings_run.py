"""The `auto` settings through the Trainer (2 CPU processes, TSP D=2): a train.memory_budget_gib
that only checkpointing with full recompute fits is what the run builds, says once at start-up,
writes to config.yaml and hands W&B."""

import pytest
import yaml

from tests.distributed.trainer_cases import captured_log, config, record_wandb
from tests.helpers.dist import run_on_ranks
from tsp_trainer.plan.auto import GIB, run_layout
from tsp_trainer.plan.hardware import get_profile
from tsp_trainer.plan.precision import FP32
from tsp_trainer.plan.predict import predict
from tsp_trainer.plan.search import memory_variants

pytestmark = pytest.mark.distributed


def _run_rank(rank, world, overrides):
    from tsp_trainer.model.activation_checkpoint import checkpointed_block
    from tsp_trainer.trainer import Trainer

    seen = record_wandb()
    with captured_log() as log:
        trainer = Trainer(config(overrides), world_size=world, global_rank=rank)
        trainer.fit()
    return {"log": log, "wandb": seen.get("config"),
            "checkpointed": trainer.par.model.block_wrapper is checkpointed_block,
            "recompute": trainer.par.model.layers[0].self_attn.recompute,
            "replay_keeps": (trainer.par.model.layers[0].self_attn.replay_keeps,
                             trainer.par.model.layers[0].mlp.replay_keeps)}


def _budget_between_checkpointing_and_the_rest(overrides) -> float:
    """Bytes above the planner's predicted peak of checkpointing + full recompute and below that
    of every candidate without checkpointing (the CPU path, fp32)."""
    cfg = config(overrides)
    model = cfg.model.to_model_config()
    peaks = {(lay.tsp_recompute, lay.activation_checkpointing):
             predict(model, lay, cfg.data.seq_len, get_profile("h100"), prec=FP32, device="cpu").memory["total"]
             for lay in memory_variants(model, run_layout(cfg, 2))}
    with_ac = peaks[("full", True)]
    without = min(v for (_, ac), v in peaks.items() if not ac)
    assert with_ac < without
    return (with_ac + without) / 2


def test_a_budget_only_checkpointing_fits_is_what_runs_says_and_records(tmp_path):
    out = tmp_path / "run"
    overrides = ["train.steps=2", "checkpoint.enabled=false", "logging.wandb_mode=offline",
                 f"train.output_dir={out}"]
    budget = _budget_between_checkpointing_and_the_rest(overrides)
    overrides.append(f"train.memory_budget_gib={budget / GIB!r}")
    outs = run_on_ranks(_run_rank, 2, overrides)
    lines = [[x for x in o["log"] if x.startswith("[rank 0] auto:")] for o in outs]
    assert len(lines[0]) == 1 and lines[1] == []               # once, by rank 0
    assert lines[0][0].startswith("[rank 0] auto: tsp_recompute=full, activation_checkpointing=true, "
                                  "head_buckets=1, checkpoint_replay_keeps=all, checkpoint_segment_blocks=1 "
                                  "(predicted peak ")
    assert all(o["replay_keeps"] == (True, True) for o in outs)      # all: the blocks' replay keeps
    assert lines[0][0].endswith(" budget: train.memory_budget_gib)")
    assert all(o["checkpointed"] and o["recompute"] == "full" for o in outs)
    written = yaml.safe_load((out / "config.yaml").read_text())
    assert (written["parallel"]["tsp_recompute"], written["train"]["activation_checkpointing"],
            written["parallel"]["head_buckets"]) == ("full", True, 1)
    assert written["parallel"]["checkpoint_replay_keeps"] == "all"
    wb = outs[0]["wandb"]
    assert (wb["parallel"]["tsp_recompute"], wb["train"]["activation_checkpointing"],
            wb["parallel"]["head_buckets"]) == ("full", True, 1)
    assert wb["run"]["auto"]["memory_budget_source"] == "train.memory_budget_gib"
    assert wb["run"]["auto"]["memory_budget_gib"] == pytest.approx(budget / GIB, abs=1e-3)
