"""Rank functions for the lifecycle tests: a preemption signal at a chosen step, W&B calls observed
by wrapping the run object's log, a crash after some steps (nothing closed, as a killed job)."""

from __future__ import annotations

import os
import signal
import time

from tests.distributed.trainer_cases import config


def preempted_rank(rank, world, overrides, at_step=None, victim=None, signame="SIGTERM"):
    """Train; the victim rank sends itself `signame` at the start of step `at_step` (the other ranks
    learn of it only through the agreement), and again when the final save starts. Returns losses, the stop reason, the step reached,
    the weights (rank 0) and, on the victim, the seconds from the signal to fit()'s return."""
    from tsp_trainer.trainer import Trainer

    trainer = Trainer(config(overrides), world_size=world, global_rank=rank)
    sent = {}
    if rank == victim:
        train_step = trainer.train_step

        def signalled_step():
            if trainer.state.step + 1 == at_step:
                sent["t"] = time.monotonic()
                os.kill(os.getpid(), getattr(signal, signame))
            return train_step()
        trainer.train_step = signalled_step
        save = trainer.save

        def signalled_again_in_save():
            if sent:                 # a second signal (the scheduler's, after the launcher's)
                os.kill(os.getpid(), getattr(signal, signame))
            return save()
        trainer.save = signalled_again_in_save
    marked = []
    trainer.sinks.mark_preempting = lambda: marked.append(True)     # what W&B would be told
    history = trainer.fit()
    returned = time.monotonic()
    weights = trainer.par.gather_full_state_dict()
    return {"losses": [h["train/loss"] for h in history], "stop_reason": trainer.stop_reason,
            "step": trainer.state.step, "weights": weights if rank == 0 else None,
            "signal_to_return_s": returned - sent["t"] if sent else None, "marked_preempting": bool(marked),
            "handlers_restored": signal.getsignal(signal.SIGTERM) is signal.SIG_DFL}


class CrashAfter(Exception):
    """Raised on every rank at the start of a step, to end a run like a crash (no final save)."""


def wandb_observed_rank(rank, world, overrides, crash_at=None):
    """Train with W&B offline; rank 0 records every step W&B receives (Run.log wrapped at class level
    before the sink exists) and the init arguments. `crash_at`: raise CrashAfter at that step's start
    on every rank, leaving the run unfinished as a crash would."""
    import wandb

    from tsp_trainer.trainer import Trainer

    received, inits = [], []
    if rank == 0:
        real_log, real_init = wandb.sdk.wandb_run.Run.log, wandb.init

        def log(run, data, step=None, **kwargs):
            received.append(step)
            return real_log(run, data, step=step, **kwargs)

        def init(**kwargs):
            inits.append({k: kwargs.get(k) for k in ("id", "resume", "resume_from", "name", "group",
                                                      "tags", "entity")})
            return real_init(**kwargs)
        wandb.sdk.wandb_run.Run.log = log
        wandb.init = init
    trainer = Trainer(config(overrides), world_size=world, global_rank=rank)
    if crash_at is not None:
        train_step = trainer.train_step

        def crashing_step():
            if trainer.state.step + 1 == crash_at:
                raise CrashAfter(f"crash at step {crash_at}")
            return train_step()
        trainer.train_step = crashing_step
    try:
        trainer.fit()
    except CrashAfter:
        pass
    run_id = trainer.session.identity.wandb_run_id
    return {"received": received, "inits": inits, "run_id": run_id, "step": trainer.state.step}
