"""The `auto` settings through the Trainer (2 CPU processes, TSP D=2): a train.memory_budget_gib
that only checkpointing with full recompute fits is what the run builds, says once at start-up,
writes to config.yaml and hands W&B; one that only the activation offload fits offloads."""

from dataclasses import replace

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


def _offload_rank(rank, world, overrides):
    from tsp_trainer.model.offload import ActivationOffload
    from tsp_trainer.trainer import Trainer

    with captured_log() as log:
        trainer = Trainer(config(overrides), world_size=world, global_rank=rank)
        history = trainer.fit()
    return {"log": log, "offloaded": isinstance(trainer.par.model.block_wrapper, ActivationOffload),
            "losses": [h["train/loss"] for h in history]}


def test_offload_auto_offloads_when_only_the_offload_fits_and_trains(tmp_path):
    """train.offload_activations=auto with a device budget between the checkpointed run's
    predicted peak with the offload and without it (the host holding the copies: on CPU what
    the two budgets leave of MemAvailable): the run builds the offload on every rank, says so once
    and writes true (the offload's losses are exact: test_offload.py)."""
    out = tmp_path / "run"
    overrides = ["train.steps=2", "checkpoint.enabled=false", f"train.output_dir={out}",
                 "train.activation_checkpointing=true", "parallel.tsp_recompute=full"]
    cfg = config(overrides)
    model, lay = cfg.model.to_model_config(), run_layout(cfg, 2)
    peak = {off: predict(model, replace(lay, activation_checkpointing=True, offload_activations=off),
                         cfg.data.seq_len, get_profile("h100"), prec=FP32, device="cpu").memory["total"]
            for off in (False, True)}
    assert peak[True] < peak[False]
    auto_run = overrides + ["train.offload_activations=auto",
                            f"train.memory_budget_gib={(peak[True] + peak[False]) / 2 / GIB!r}"]
    outs = run_on_ranks(_offload_rank, 2, auto_run)
    lines = [x for x in outs[0]["log"] if x.startswith("[rank 0] auto:")]
    assert len(lines) == 1 and ("checkpoint_segment_blocks=1, offload_activations=true, offload_prefetch=true "
                                "(predicted peak ") in lines[0]
    assert all(o["offloaded"] for o in outs)
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["offload_activations"] is True
    assert outs[0]["losses"] == outs[1]["losses"] and len(outs[0]["losses"]) == 2
