"""The run's identity across relaunches: one W&B run id and name per run folder.

The id is created once, by global rank 0, and kept in <output_dir>/run.json and in every
checkpoint's meta.json (`run`). A relaunch that continues the folder (train.resume=auto, or a
checkpoint of this folder) takes the stored id, so W&B shows one run across preemptions and
requeues; a fresh start (train.resume=none, overwrite, or a checkpoint of another folder) gets a new
id. The name is logging.run_name, or else the output folder's name.

How replayed steps reach W&B is decided here too (`wandb_replay`), see docs/reliability.md "W&B
continuity": steps between the checkpoint and the crash ran before and run again after a resume.
- "skip" (default): continue the run (resume="allow") and log nothing up to the last step the
  earlier launch logged. Exact resume makes the replayed values bit-identical to the logged ones, so
  nothing is lost; works offline, online and on self-hosted servers.
- "rewind": wandb.init(resume_from="<id>?_step=<checkpoint step>"): W&B truncates the history to
  the checkpoint's step and the replayed steps are logged again. Needs the server's rewind feature
  (a preview on W&B cloud, absent from self-managed servers in 2026), hence not the default.
Never imports wandb; the sink (observability/wandb_sink.py) does.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import asdict, dataclass
from pathlib import Path

from tsp_trainer.checkpoint.disk_format import atomic_write_text
from tsp_trainer.run.rundir import RUN_FILE


@dataclass(frozen=True)
class RunIdentity:
    wandb_run_id: str       # 8 lowercase hex characters, valid as a W&B run id
    name: str               # display name: logging.run_name or the output folder's name

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class WandbResume:
    """How the W&B sink opens the run: a new one, or the same id continued (skip / rewind)."""

    continues: bool                    # the run existed before this launch
    skip_through_step: int | None      # "skip": drop steps <= this (already logged)
    rewind_to_step: int | None         # "rewind": truncate the W&B history to this step


def new_run_id() -> str:
    return secrets.token_hex(4)


def derive_run_name(output_dir: str | os.PathLike, run_name: str | None) -> str:
    return run_name if run_name else Path(os.path.abspath(output_dir)).name


def resolve_identity(output_dir: str | os.PathLike, *, run_name: str | None, continues: bool,
                     checkpoint_meta: dict | None) -> RunIdentity:
    """Global rank 0: the identity this launch logs under, written to run.json.

    Args:
        continues: this launch continues the folder's run (a resume from one of its checkpoints,
            or train.resume=auto with nothing saved yet); False starts a new run.
        checkpoint_meta: meta.json of the checkpoint resumed from (its `run` entry is used when
            run.json is missing, e.g. the folder was copied without it).
    """
    stored = read_identity(output_dir) if continues else None
    if stored is None and continues and checkpoint_meta and "run" in checkpoint_meta:
        stored = RunIdentity(**checkpoint_meta["run"])
    run_id = stored.wandb_run_id if stored else new_run_id()
    name = run_name or (stored.name if stored else derive_run_name(output_dir, None))
    identity = RunIdentity(run_id, name)
    atomic_write_text(Path(output_dir) / RUN_FILE, json.dumps(identity.as_dict(), indent=1) + "\n")
    return identity


def read_identity(output_dir: str | os.PathLike) -> RunIdentity | None:
    path = Path(output_dir) / RUN_FILE
    try:
        raw = json.loads(path.read_text())
        return RunIdentity(wandb_run_id=str(raw["wandb_run_id"]), name=str(raw["name"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def wandb_resume(*, replay: str, continues: bool, resumed_step: int,
                 last_logged_step: int | None) -> WandbResume:
    """The sink's resume plan. `last_logged_step` is the newest step the earlier launches logged
    (metrics.jsonl before it was cut back); `resumed_step` the checkpoint's step (0 if none)."""
    if not continues:
        return WandbResume(False, None, None)
    if replay == "rewind":
        return WandbResume(True, None, resumed_step)
    return WandbResume(True, last_logged_step, None)
