"""Which checkpoint `train.resume=auto` continues from: the newest one of the run's checkpoints
folder that verifies (manifest present, every listed file there with its size and sha256).

    choice = newest_verified_checkpoint(root)     # global rank 0 only, before any process group
    choice.path                                   # the checkpoint to resume, or None (step 0)
    choice.warnings, choice.notes                 # one line per fact, for rank 0's log

The candidates, newest first: the folder `latest` names and the step_* folders older than it
(later ones belong to an abandoned continuation and are pruned at the next save, store.py); with
no usable pointer, every step_* folder. A candidate that fails verification, a step_* folder
without a manifest included (a published folder always has one), is moved to
`<root>/damaged/<name>` (never deleted: `damaged/` is outside what resume, `latest` and pruning
look at) and the next older one is tried. `latest` is then repointed (os.replace) to the one used.

A verified candidate's rank state files must also read as plain data (checkpoint/rank_file.py:
nothing from them runs): rank 0 reads each one here, before any process group. A refused one stops
the launch with one line naming the file and the type found (check_rank_states_before_resume);
under train.resume=auto its checkpoint is first set aside like a damaged one, so the next launch
resumes the newest one before it that verifies. A checkpoint of the older rank-state format is not
moved: the line gives the command that converts it.

This module renames folders: only one process may run it, and the others must not read the
folder until it is done (run/inputs.py: rank 0 runs it before the process groups exist; the other
ranks take its choice after them, in TrainingCheckpoints.load).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from tsp_trainer.checkpoint.disk_format import (LATEST, MANIFEST, atomic_write_text, folder_bytes,
                                                verify_manifest)
from tsp_trainer.checkpoint.rank_file import RankStateRefused, check_rank_states

DAMAGED = "damaged"


@dataclass(frozen=True)
class ResumeChoice:
    path: Path | None                    # the verified checkpoint to resume; None: start at step 0
    warnings: tuple[str, ...] = ()       # one per folder set aside, then the fallback
    notes: tuple[str, ...] = ()          # the verification of the one chosen: files, bytes, seconds


def newest_verified_checkpoint(root: str | os.PathLike) -> ResumeChoice:
    """The newest checkpoint of `root` that verifies; the damaged newer ones are set aside."""
    root = Path(root)
    warnings: list[str] = []
    for folder in resume_candidates(root):
        started = time.perf_counter()
        problem = verify_manifest(folder)
        if problem is None:
            if warnings:
                warnings.append(f"train.resume=auto: falling back to {folder.name}, the newest "
                                "checkpoint that verifies")
            repoint_latest(root, folder)
            return ResumeChoice(folder, tuple(warnings),
                                (verified_line(folder, time.perf_counter() - started),))
        aside = set_aside(folder)
        warnings.append(_skipped_line(folder, problem, aside))
    # None left: the run folder's start-up says "no checkpoint in ..., starting at step 0".
    return ResumeChoice(None, tuple(warnings))


def check_rank_states_before_resume(folder: Path, *, resume: str) -> None:
    """Global rank 0, before any process group: every rank state file of the checkpoint to resume
    reads as plain data, else ValueError (exit 2) naming the file and the type found. Under
    train.resume=auto the checkpoint is set aside first (as a damaged one is), unless it is of the
    older format, which the line says how to convert."""
    try:
        check_rank_states(folder)
    except RankStateRefused as err:
        if resume != "auto" or err.older_format:
            raise ValueError(f"train.resume={resume}: {err}") from None
        aside = set_aside(folder)
        raise ValueError(f"train.resume=auto: {err}; moved {folder.name} to {aside}: the next launch "
                         "resumes from the newest checkpoint before it that verifies") from None


def resume_candidates(root: Path) -> list[Path]:
    """step_* folders newest first, from the one `latest` names (all of them without a pointer)."""
    folders = sorted((p for p in root.glob("step_*") if p.is_dir()), reverse=True)
    pointer = root / LATEST
    named = pointer.read_text().strip() if pointer.is_file() else ""
    if named and (root / named).is_dir():
        return [p for p in folders if p.name <= named]
    return folders


def set_aside(folder: Path) -> Path:
    """Move a damaged checkpoint to <root>/damaged/<name> (<name>.1, .2, ... if taken); its path."""
    damaged = folder.parent / DAMAGED
    damaged.mkdir(exist_ok=True)
    target, n = damaged / folder.name, 1
    while target.exists():
        target, n = damaged / f"{folder.name}.{n}", n + 1
    os.rename(folder, target)
    return target


def repoint_latest(root: Path, folder: Path) -> None:
    pointer = root / LATEST
    if not pointer.is_file() or pointer.read_text().strip() != folder.name:
        atomic_write_text(pointer, folder.name + "\n")


def verified_line(folder: Path, seconds: float) -> str:
    files = len(list(p for p in folder.rglob("*") if p.is_file()))
    return (f"checkpoint {folder.name} verified: {files} files, "
            f"{folder_bytes(folder) / 2**20:.1f} MiB hashed in {seconds:.2f} s")


def _skipped_line(folder: Path, problem: str, aside: Path) -> str:
    if not (aside / MANIFEST).exists():
        return (f"train.resume=auto: skipping {folder}: no {MANIFEST} (a published checkpoint "
                f"always has one); moved to {aside}")
    return f"train.resume=auto: skipping {folder}: {problem}; moved to {aside}"
