"""The run folder (train.output_dir): who may write into it, what a relaunch does with it, and the
files that must agree with the checkpoint a run continues from.

    <output_dir>/
        config.yaml       resolved config of the newest launch
        run.json          the run's identity: W&B run id and name (run/identity.py)
        metrics.jsonl     one line per logged step, each step once (cut back to the resumed step)
        checkpoints/      step_* folders and `latest` (checkpoint/disk_format.py)
        hang_dumps/       rank_XXXXX.txt, written by the hang watchdog (run/watchdog.py)
        .lease.lock       flock-ed by the job that holds the folder (run/lease.py)
        lease.json        that job's host, pid, job id and start; touched as its heartbeat

Rules (docs/reliability.md, "Output folders"):
- One job at a time: a folder whose lease another live job holds is refused (run/lease.py).
- A launch with train.resume=none into a folder that holds checkpoints is refused, naming the
  choices: train.resume=auto, another train.output_dir, or train.overwrite_output_dir=true.
- train.resume accepts a step_* folder, a checkpoints folder or a run folder (its latest).
- train.resume=auto continues from the newest checkpoint that verifies; damaged newer ones are
  moved to checkpoints/damaged/ (checkpoint/fallback.py). An explicit path that fails verification
  is refused. A rank state file that needs anything but plain data is refused (exit 2, the file
  and type named); under train.resume=auto its checkpoint is first moved to checkpoints/damaged/.
- After a resume from step s, metrics.jsonl holds each step <= s once (rewritten atomically), so
  the steps replayed after a crash appear once.

`check_output_dir` and `resolve_resume` only read (and probe writability); they run before any
process group exists (run/inputs.py). `choose_resume` hashes and, under train.resume=auto, renames
damaged checkpoints aside and repoints `latest`: on global rank 0 only, before the process groups.
`claim_output_dir` mutates and runs on global rank 0 only. Imports nothing of ours but
checkpoint.disk_format's path helpers and checkpoint.fallback.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from tsp_trainer.checkpoint.disk_format import (MANIFEST, atomic_write_text, find_checkpoint,
                                                latest_checkpoint, verify_manifest)
from tsp_trainer.checkpoint.fallback import (ResumeChoice, check_rank_states_before_resume,
                                             newest_verified_checkpoint)

CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
RUN_FILE = "run.json"
LAYOUTS = "layouts.jsonl"      # one line per launch: its first step, layout and device (tsp-report)
HANG_DUMPS = "hang_dumps"


def checkpoints_root(output_dir: str | os.PathLike) -> Path:
    return Path(output_dir) / CHECKPOINTS


def choose_resume(resume: str, output_dir: str | os.PathLike, *, rank: int) -> ResumeChoice:
    """The checkpoint this launch continues from, verified (sizes and sha256, and every rank state
    file read as plain data: checkpoint/rank_file.py) by global rank 0.

    Rank 0: 'auto' takes the newest checkpoint that verifies (setting damaged ones aside); an
    explicit path must verify, else ValueError naming the file. Other ranks hash nothing: under
    'auto' they return no path and take rank 0's choice once the process groups exist
    (TrainingCheckpoints.load); an explicit path is only resolved."""
    if resume == "none" or (resume == "auto" and rank != 0):
        return ResumeChoice(None)
    if resume == "auto":
        choice = newest_verified_checkpoint(checkpoints_root(output_dir))
        if choice.path is not None:
            check_rank_states_before_resume(choice.path, resume=resume)
        return choice
    path = resolve_resume(resume, output_dir)
    if rank == 0:
        if (problem := verify_manifest(path)) is not None:
            raise ValueError(f"train.resume={resume!r}: {problem}; pass another checkpoint, or "
                             "train.resume=auto to take the newest one of this run that verifies")
        check_rank_states_before_resume(path, resume=repr(resume))
    return ResumeChoice(path)


def resolve_resume(resume: str, output_dir: str | os.PathLike) -> Path | None:
    """The checkpoint train.resume names, not verified (None for 'none', or 'auto' with nothing
    to resume)."""
    if resume == "none":
        return None
    if resume == "auto":
        return latest_checkpoint(checkpoints_root(output_dir))
    found = find_checkpoint(resume)
    if found is None and Path(resume).name.startswith("step_") and Path(resume).is_dir():
        raise ValueError(f"train.resume={resume!r}: checkpoint {resume} has no {MANIFEST}: it is "
                         "incomplete or damaged; pass another checkpoint or train.resume=auto")
    if found is None:
        raise ValueError(f"train.resume={resume!r} is neither a complete checkpoint (a step_* folder "
                         f"with {MANIFEST}) nor a run or checkpoints folder holding one; pass 'auto', "
                         "'none', a step_* folder or a run folder")
    return found


def check_output_dir(output_dir: str, *, resume: str, resume_path: Path | None, overwrite: bool) -> None:
    """Refuse to mix two runs in one folder, and an output folder this process cannot write.
    Creates the folder if it is missing (the probe needs it; training would create it anyway)."""
    root = checkpoints_root(output_dir)
    existing = latest_checkpoint(root)
    inside = resume_path is not None and is_inside(resume_path, root)
    if overwrite and (resume == "auto" or inside):
        raise ValueError(f"train.overwrite_output_dir=true would delete the checkpoints of "
                         f"{output_dir!r} that train.resume={resume!r} continues from; drop one of them")
    foreign = resume not in ("none", "auto") and not inside      # another folder's checkpoint
    if existing is not None and not overwrite and (resume == "none" or foreign):
        what = ("train.resume=none starts a new run" if resume == "none" else
                f"train.resume={resume!r} continues another run's checkpoint")
        raise ValueError(f"train.output_dir={output_dir!r} already holds checkpoints of a run (latest "
                         f"{existing.name}) and {what}; continue that run with train.resume=auto, "
                         "write to another train.output_dir, or set train.overwrite_output_dir=true "
                         "to delete them and start over")
    probe_writable(output_dir)


def probe_writable(output_dir: str) -> None:
    try:
        os.makedirs(output_dir, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write_probe.", dir=output_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ValueError(f"train.output_dir={output_dir!r} is not writable ({err.strerror or err}); "
                         "point it at a folder this job can write to") from err


def is_inside(path: Path, root: Path) -> bool:
    """Whether `path` lies in the folder `root` (both resolved)."""
    try:
        Path(path).resolve().relative_to(Path(root).resolve())
        return True
    except ValueError:
        return False


def abandoned_checkpoints(output_dir: str | os.PathLike, resume_path: Path | None) -> list[str]:
    """Checkpoints of this folder newer than the one resumed (a rollback): the first save of the
    resumed run prunes them (checkpoint/store.py), so the caller says so up front."""
    if resume_path is None or not is_inside(resume_path, checkpoints_root(output_dir)):
        return []
    return sorted(p.name for p in checkpoints_root(output_dir).glob("step_*")
                  if (p / MANIFEST).exists() and p.name > Path(resume_path).name)


def claim_output_dir(output_dir: str | os.PathLike, *, overwrite: bool) -> list[str]:
    """Global rank 0, before anything is written: with train.overwrite_output_dir, remove the earlier
    run's checkpoints, metrics and identity. Returns what was removed."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    removed = []
    if overwrite:
        for name in (CHECKPOINTS, METRICS, RUN_FILE, LAYOUTS):
            target = out / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
            else:
                continue
            removed.append(name)
    return removed


def record_layout(output_dir: str | os.PathLike, *, first_step: int, layout: dict, device: str) -> None:
    """Global rank 0, at each launch: append {first_step, layout, device} to layouts.jsonl,
    dropping the lines of launches that began after `first_step` (a rollback abandoned them)."""
    path = Path(output_dir) / LAYOUTS
    kept = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue                     # a line a crash cut short
            if record.get("first_step", 0) < first_step:
                kept.append(record)
    kept.append({"first_step": first_step, **layout, "device": device})
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, path)


def rewrite_metrics(path: str | os.PathLike, *, up_to_step: int) -> int | None:
    """Cut metrics.jsonl back to the steps <= up_to_step, one line per step (the last written wins),
    atomically. Returns the highest step the file held before (the last step any sink logged), or
    None if there was no file. Lines a crash cut short are dropped."""
    path = Path(path)
    if not path.exists():
        return None
    by_step: dict[int, str] = {}
    last = None
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            step = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
        last = step if last is None else max(last, step)
        if step <= up_to_step:
            by_step[step] = line
    text = "".join(by_step[s] + "\n" for s in sorted(by_step))
    if text != path.read_text(encoding="utf-8"):
        atomic_write_text(path, text)
    return last
