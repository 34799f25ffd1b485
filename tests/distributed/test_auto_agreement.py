"""`auto` is decided once for the job (run/startup.py): ranks that read different memory figures
(plan/auto.py `device_budget`, patched per rank) run the settings global rank 0 chose, on the CPU
path through the Trainer, and on the GPU path's code (cuda=True, the reading and the device name
patched); a refusal on rank 0 is every rank's AutoSettingsError (the CLI prints it once, exit 2)."""

import pytest

from tests.distributed.trainer_cases import config
from tests.helpers.dist import run_on_ranks
from tsp_trainer.plan.auto import GIB, Budget

pytestmark = pytest.mark.distributed

# recompute, checkpointing and buckets all auto; rank 0 reads plenty, rank 1 almost nothing
AUTO = ["train.steps=2", "checkpoint.enabled=false", "parallel.tsp_recompute=auto",
        "train.activation_checkpointing=auto", "parallel.head_buckets=auto"]
DTYPE_AUTO = ["train.dtype=auto"]            # bf16 on the GPU path, fp32 on CPU
READINGS = {0: 64 * GIB, 1: 1024.0}


def _patch_reading(readings: dict, rank: int, *, gpu: bool = False) -> None:
    from tsp_trainer.plan import auto

    auto.device_budget = lambda **kw: Budget(readings[rank], f"patched reading of rank {rank}")
    if gpu:                                   # the GPU profile's name, without a GPU
        auto.ranking_profile = lambda cuda, device=None: auto.PROFILES["h100"]


def _train(rank, world, overrides, readings):
    from tsp_trainer.trainer import Trainer

    _patch_reading(readings, rank)
    trainer = Trainer(config(overrides), world_size=world, global_rank=rank)
    history = trainer.fit()
    c, attn = trainer.cfg, trainer.par.model.layers[0].self_attn
    return {"settings": (c.parallel.tsp_recompute, c.train.activation_checkpointing,
                         c.parallel.head_buckets, c.parallel.checkpoint_replay_keeps),
            "built": attn.recompute, "losses": [h["train/loss"] for h in history]}


def test_ranks_reading_different_memory_run_rank_0s_choice_and_train(tmp_path):
    outs = run_on_ranks(_train, 2, AUTO + [f"train.output_dir={tmp_path / 'run'}"], READINGS)
    assert outs[0]["settings"] == outs[1]["settings"]
    assert outs[0]["settings"][0] == outs[0]["built"] == outs[1]["built"]
    assert "auto" not in outs[0]["settings"]
    assert len(outs[0]["losses"]) == 2 and outs[0]["losses"] == outs[1]["losses"]


def _settle(rank, world, overrides, readings, cuda):
    import types

    import torch

    from tsp_trainer.run.inputs import check_inputs
    from tsp_trainer.run.startup import settle

    _patch_reading(readings, rank, gpu=cuda)
    cfg = config(overrides)
    # on CPU rank 0 decides in its input check; on a GPU machine after set_device, in settle
    inputs = types.SimpleNamespace(resolved=None) if cuda else check_inputs(cfg, world_size=world, rank=rank)
    try:
        resolved = settle(cfg, inputs, world_size=world, rank=rank, cuda=cuda, device=torch.device("cpu"))
    except ValueError as err:
        return {"error": str(err), "agreed": getattr(err, "agreed", False)}
    c = resolved.cfg
    return {"settings": (c.parallel.tsp_recompute, c.train.activation_checkpointing,
                         c.parallel.head_buckets, c.parallel.checkpoint_replay_keeps, c.train.dtype),
            "line": resolved.line()}


@pytest.mark.parametrize("cuda", [False, True], ids=["cpu", "gpu-path"])
def test_every_rank_takes_rank_0s_decision(tmp_path, cuda):
    outs = run_on_ranks(_settle, 2, AUTO + DTYPE_AUTO + [f"train.output_dir={tmp_path / 'run'}"],
                        READINGS, cuda)
    assert outs[0] == outs[1]
    assert outs[0]["line"].endswith("budget: patched reading of rank 0)")
    assert outs[0]["settings"][4] == ("bf16" if cuda else "fp32")


def test_a_refusal_on_rank_0_is_every_ranks_agreed_error(tmp_path):
    """The GPU path (on CPU, rank 0's own input check refuses first: one line before any group)."""
    readings = {0: READINGS[1], 1: READINGS[0]}            # rank 0 reads almost nothing
    outs = run_on_ranks(_settle, 2, AUTO + [f"train.output_dir={tmp_path / 'run'}"], readings, True)
    assert outs[0] == outs[1]
    assert outs[0]["agreed"] and "nothing fits the memory budget" in outs[0]["error"]
    assert "patched reading of rank 0" in outs[0]["error"]
