"""Rank functions that inject faults into a real Trainer (a SIGKILL mid-ring or mid-save, a NaN
loss on one rank) by wrapping one of its methods on the victim rank only."""

from __future__ import annotations

import os
import signal

import torch

from tests.distributed.trainer_cases import config


def _kill_self():
    os.kill(os.getpid(), signal.SIGKILL)


def faulty_train_rank(rank, world, overrides, fault):
    """fault = (kind, at_step, victim_rank); kind in {"ring", "save", "async_write", "nan"}."""
    from tsp_trainer.engine.zero_state import whole_parameters
    from tsp_trainer.trainer import NonFiniteError, Trainer

    trainer = Trainer(config(overrides), world_size=world, global_rank=rank)
    kind, at_step, victim = fault
    if rank == victim:
        _inject(trainer, kind, at_step)
    try:
        history = trainer.fit()
    except NonFiniteError as err:
        return {"stopped": str(err), "step": trainer.state.step}
    with whole_parameters(trainer.par.model):                # ZeRO-3 (sp, ulysses): gathered
        weights = {k: v.clone() for k, v in trainer.par.gather_full_state_dict().items()}   # collective
    return {"losses": [h["train/loss"] for h in history], "skipped": [h["train/skipped"] for h in history],
            "weights": weights if rank == 0 else None,
            "step": trainer.state.step}


def _inject(trainer, kind, at_step):
    def due():
        return trainer.state.step + 1 == at_step

    if kind == "ring":                       # die inside the MLP ring of the last layer's forward
        mlp = trainer.par.model.layers[-1].mlp
        forward = mlp.forward
        mlp.forward = lambda x: _kill_self() if due() else forward(x)
    elif kind == "save":                     # die after writing the shards, before publish
        store = trainer.checkpoints.store
        write = store.write_rank_state
        store.write_rank_state = lambda tmp, st: (
            _kill_self() if trainer.state.step == at_step else write(tmp, st))
    elif kind == "async_write":              # die in the background writer thread of a save
        store = trainer.checkpoints.store
        write = store.write_rank_state

        def write_then_die(tmp, state):
            if f"step_{at_step:08d}" in str(tmp):
                assert trainer.checkpoints.writer.async_save
                _kill_self()
            return write(tmp, state)
        store.write_rank_state = write_then_die
    elif kind == "nan":                      # one rank's loss turns NaN
        module = trainer.engine.module
        loss_sum = module.loss_sum

        def poisoned(*args, **kwargs):
            total, count = loss_sum(*args, **kwargs)
            return (total + float("nan") if due() else total), count
        module.loss_sum = poisoned
    else:
        raise ValueError(kind)


def weights_equal(a, b) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def assert_nan_step_is_skipped(world: int, overrides: list[str], out_dir) -> None:
    """Step 3's loss is NaN on rank 1 only: every rank skips that update (counted), so with a
    constant learning rate in `overrides` the weights after 3 steps equal those after 2 clean
    steps."""
    from tests.distributed.trainer_cases import train_rank
    from tests.helpers.dist import run_on_ranks

    out = run_on_ranks(faulty_train_rank, world, overrides + ["train.steps=3", "train.nonfinite=skip",
                                                              f"train.output_dir={out_dir}/a"], ("nan", 3, 1))
    for o in out:
        assert o["skipped"] == [0, 0, 1]
    clean = run_on_ranks(train_rank, world, overrides + ["train.steps=2", f"train.output_dir={out_dir}/b"])
    assert weights_equal(out[0]["weights"], clean[0]["weights"])
