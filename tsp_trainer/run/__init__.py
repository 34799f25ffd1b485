"""The job's lifecycle around the training loop: inputs checked before
start-up (inputs.py; once under tsp-launch, and rank 0's `auto` decision broadcast to every rank:
startup.py), a worker that stops when its launcher dies (launcher_watch.py), the run folder and its reuse rules (rundir.py), one job per run folder
(lease.py: an OS lock plus a lease file, held by global rank 0), the run's W&B identity across
requeues (identity.py), preemption signals and the max-runtime clock agreed by all ranks at step
boundaries (preemption.py), and the hang watchdog with its stack dumps (watchdog.py).

trainer.py and cli.py call these; nothing here imports them, accelerate, deepspeed or wandb.
Collectives go through parallel.comm.Comm like everywhere else.
"""

from tsp_trainer.run.identity import RunIdentity, WandbResume, resolve_identity, wandb_resume
from tsp_trainer.run.inputs import CheckedInputs, check_inputs, check_same_model, run_layout
from tsp_trainer.run.preemption import EXIT_INTERRUPTED, EXIT_PREEMPTED, StopAgreement
from tsp_trainer.run.rundir import (abandoned_checkpoints, check_output_dir, claim_output_dir,
                                    resolve_resume, rewrite_metrics)
from tsp_trainer.run.watchdog import HangWatchdog

EXIT_BAD_INPUT = 2          # a config, data, tokenizer, output-folder or resume-path error

__all__ = ["EXIT_BAD_INPUT", "EXIT_INTERRUPTED", "EXIT_PREEMPTED", "CheckedInputs", "HangWatchdog", "RunIdentity",
           "StopAgreement", "WandbResume", "abandoned_checkpoints", "check_inputs",
           "check_output_dir", "check_same_model", "claim_output_dir", "resolve_identity",
           "resolve_resume", "rewrite_metrics", "run_layout", "wandb_resume"]
