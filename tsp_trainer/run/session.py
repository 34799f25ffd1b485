"""What one launch does to its run folder at start-up, after the resume point is known and before
anything is logged or saved: the overwrite (if asked), metrics.jsonl cut back to the resumed step,
the run identity (new or continued) and how W&B treats the replayed steps.

Collective over the world group: global rank 0 does the work, every rank gets the same identity.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tsp_trainer.config import TrainConfig
from tsp_trainer.parallel.comm import Comm
from tsp_trainer.run.identity import (RunIdentity, WandbResume, read_identity, resolve_identity,
                                     wandb_resume)
from tsp_trainer.run.rundir import (METRICS, abandoned_checkpoints, checkpoints_root,
                                    claim_output_dir, is_inside, record_layout, rewrite_metrics)


@dataclass(frozen=True)
class RunSession:
    identity: RunIdentity
    wandb: WandbResume
    notes: tuple[str, ...]          # one line each, for the rank-0 log (what start-up decided)


def open_run_folder(cfg: TrainConfig, *, world: Comm, resume_path: Path | None,
                    resume_meta: dict | None, resumed_step: int, layout: dict | None = None,
                    device: str = "cpu") -> RunSession:
    """Collective (world): rank 0 claims the folder and decides the identity; all ranks return it.
    `layout` (checkpoint_layout) and `device` (its type) go to layouts.jsonl for tsp-report."""
    session = None
    if world.rank == 0:
        session = _open_on_rank0(cfg, resume_path, resume_meta, resumed_step)
        if layout is not None:
            record_layout(cfg.train.output_dir, first_step=resumed_step + 1, layout=layout, device=device)
    return world.broadcast_object(session)


def _open_on_rank0(cfg: TrainConfig, resume_path: Path | None, resume_meta: dict | None,
                   resumed_step: int) -> RunSession:
    t = cfg.train
    out = t.output_dir
    notes = []
    removed = claim_output_dir(out, overwrite=t.overwrite_output_dir)
    if removed:
        notes.append(f"train.overwrite_output_dir=true: removed {', '.join(removed)} of an earlier "
                     f"run from {out}")
    if resume_path is None and t.resume == "auto":
        notes.append(f"train.resume=auto: no checkpoint in {checkpoints_root(out)}, starting at step 0")
    later = abandoned_checkpoints(out, resume_path)
    if later:
        notes.append(f"resuming {resume_path.name} of this folder: the later checkpoints "
                     f"{', '.join(later)} belong to the abandoned continuation and are removed at "
                     "the first save")
    last_logged = rewrite_metrics(Path(out) / METRICS, up_to_step=resumed_step)
    if last_logged is not None and last_logged > resumed_step:
        notes.append(f"{METRICS} cut back to step {resumed_step} (it held steps up to {last_logged}); "
                     "the steps after it run again")
    # The folder's run continues when this launch resumes one of its checkpoints, or when
    # resume=auto found none but the run exists (a requeue before its first save).
    continues = (resume_path is not None and is_inside(resume_path, checkpoints_root(out))) or (
        resume_path is None and t.resume == "auto" and read_identity(out) is not None)
    identity = resolve_identity(out, run_name=cfg.logging.run_name, continues=continues,
                                checkpoint_meta=resume_meta)
    plan = wandb_resume(replay=cfg.logging.wandb_replay, continues=continues,
                        resumed_step=resumed_step, last_logged_step=last_logged)
    return RunSession(identity, plan, tuple(notes))

