"""Checkpoint save/resume: atomic publication, `latest` pointer, keep-last-K, manifest.

Layout of one checkpoint (all ranks write into a temporary folder on a shared filesystem):

    <root>/step_00000020/
        model/model-tspXXX-of-YYY[-partPPP-of-QQQ].safetensors  model shards (checkpoint/shards.py)
        optim/optim-tspXXX-of-YYY[-partPPP-of-QQQ].safetensors  optimizer state (checkpoint/reshard.py)
        ranks/rank_XXXXX.pt               per-rank state: data loader, RNG, scheduler, counters
        meta.json                         step, tokens seen, layout, model config, resolved config
        manifest.json                     every file with its size and sha256 (written last)
    <root>/latest                         name of the newest complete checkpoint

A checkpoint is written as `.step_00000020.tmp`, renamed to its final name only after every rank
has finished and the manifest is written, and only then does `latest` move (os.replace). A crash
at any point leaves `latest` naming the previous complete checkpoint; stale temporaries are removed
by the next save. Each rank hashes the files it wrote (checkpoint/async_writer.py); rank 0 only
merges the entries into the manifest. Loading verifies the manifest (sizes and checksums) before
anything is read, each rank checking a share of the files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

from tsp_trainer.parallel.comm import Comm

LATEST = "latest"
MANIFEST = "manifest.json"
META = "meta.json"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


class CheckpointManager:
    def __init__(self, root: str | os.PathLike, *, world: Comm, keep_last: int = 3):
        self.root = Path(root)
        self.world = world
        self.keep_last = keep_last

    # -- save -------------------------------------------------------------------------------------
    def begin(self, step: int) -> Path:
        """Collective: create a clean temporary folder for `step`; returns its path."""
        tmp = self.root / f".{step_dir_name(step)}.tmp"
        if self.world.rank == 0:
            for stale in self.root.glob(".step_*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)
            for sub in ("model", "optim", "ranks"):
                (tmp / sub).mkdir(parents=True, exist_ok=True)
        self.world.barrier()
        return tmp

    def abort(self, tmp: Path) -> None:
        """Remove a temporary folder whose save failed (any rank may; the next begin() also would)."""
        shutil.rmtree(tmp, ignore_errors=True)

    def write_rank_state(self, tmp: Path, state: dict) -> dict[str, dict]:
        """Write this rank's ranks/rank_XXXXX.pt; returns its manifest entry {rel: {bytes, sha256}}."""
        rel = f"ranks/rank_{self.world.rank:05d}.pt"
        atomic_torch_save(state, tmp / rel)
        return {rel: file_entry(tmp / rel)}

    def publish(self, tmp: Path, step: int, meta: dict, files: dict[str, dict]) -> Path:
        """Collective: once every rank has written into `tmp`, rank 0 writes meta + manifest,
        renames the folder into place, moves `latest` and prunes old checkpoints.

        `files`: this rank's manifest entries {rel: {bytes, sha256}} (each rank hashed what it
        wrote), gathered to rank 0: no rank hashes the whole checkpoint."""
        entries = self.world.gather_object(files)
        final = self.root / step_dir_name(step)
        if self.world.rank == 0:
            atomic_write_text(tmp / META, json.dumps(meta, indent=2, sort_keys=True))
            manifest = _merged_manifest(tmp, entries)
            atomic_write_text(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
            _fsync_dir(tmp)
            old = final.with_name(f".{final.name}.replaced") if final.exists() else None
            if old is not None:           # re-saving a step: swap folders, never delete first
                shutil.rmtree(old, ignore_errors=True)
                os.rename(final, old)
            os.rename(tmp, final)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            _fsync_dir(self.root)
            atomic_write_text(self.root / LATEST, final.name + "\n")
            self._prune(final)
        self.world.barrier()
        return final

    def _prune(self, final: Path) -> None:
        """Keep `final` (the checkpoint `latest` now names) and the keep_last - 1 newest before it.
        Checkpoints of later steps than `final` belong to an abandoned timeline (the run resumed
        from an earlier checkpoint of this folder): they go first, so pruning can never delete the
        checkpoint `latest` names."""
        if self.keep_last <= 0:
            return
        done = [p for p in self.root.glob("step_*") if (p / MANIFEST).exists() and p.name != final.name]
        older = sorted(p for p in done if p.name < final.name)
        abandoned = [p for p in done if p.name > final.name]
        for old in abandoned + older[:max(len(older) - (self.keep_last - 1), 0)]:
            shutil.rmtree(old, ignore_errors=True)

    # -- resume -----------------------------------------------------------------------------------
    def latest(self) -> Path | None:
        return latest_checkpoint(self.root)

    def resolve(self, resume: str) -> Path | None:
        """"none" -> None; "auto" -> the latest complete checkpoint (None if there is none);
        anything else is a checkpoint folder, or a run / checkpoints folder whose latest is taken."""
        if resume == "none":
            return None
        if resume == "auto":
            return self.latest()
        path = find_checkpoint(resume)
        if path is None:
            raise ValueError(f"train.resume={resume!r} is neither a complete checkpoint folder (a "
                             f"step_* folder with {MANIFEST}) nor a run or checkpoints folder that "
                             "holds one; pass 'auto', 'none', a step_* folder or a run folder")
        return path

    def verify(self, path: Path) -> dict:
        """Collective: every rank checks a share of the manifest's files (file i on rank
        i % world); all ranks get meta or the first error."""
        errors = self.world.all_gather_object(
            verify_manifest(path, share=(self.world.rank, self.world.size)))
        error = next((e for e in errors if e), None)
        if error:
            raise ValueError(error)
        return json.loads((path / META).read_text())

    def read_rank_state(self, path: Path, rank: int | None = None) -> dict:
        """This rank's state, or saved rank `rank`'s (a resume under another layout)."""
        rank = self.world.rank if rank is None else rank
        return torch.load(path / "ranks" / f"rank_{rank:05d}.pt", weights_only=False)


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The complete checkpoint `root/latest` names; if the pointer is missing or names an
    incomplete folder (deleted by hand), the complete step_* folder of the highest step."""
    root = Path(root)
    pointer = root / LATEST
    if pointer.is_file():
        path = root / pointer.read_text().strip()
        if (path / MANIFEST).exists():
            return path
    complete = sorted(p for p in root.glob("step_*") if (p / MANIFEST).exists())
    return complete[-1] if complete else None


def find_checkpoint(path: str | os.PathLike) -> Path | None:
    """The checkpoint `path` names: a step_* folder itself, or the latest complete checkpoint of a
    checkpoints root or of a run folder (its checkpoints/ subfolder); None if it names none."""
    path = Path(path)
    if (path / MANIFEST).exists():
        return path
    for root in (path, path / "checkpoints"):
        if root.is_dir() and (found := latest_checkpoint(root)) is not None:
            return found
    return None


def read_verified_meta(folder: Path) -> dict:
    """One process, no group: meta.json of a checkpoint whose manifest checks out, or ValueError."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder (expected a checkpoint step_* folder)")
    try:
        error = verify_manifest(folder)
    except (ValueError, KeyError, TypeError) as err:        # json.JSONDecodeError is a ValueError
        error = f"checkpoint {folder} has an unreadable {MANIFEST} ({err!r})"
    if error:
        raise ValueError(error)
    try:
        return json.loads((folder / META).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{folder} has a manifest but no readable {META}: not a tsp_trainer "
                         f"checkpoint ({err})") from err


def build_manifest(folder: Path) -> dict:
    files = {}
    for f in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST):
        files[str(f.relative_to(folder))] = file_entry(f)
    return {"version": 1, "files": files}


def _merged_manifest(folder: Path, per_rank: list[dict[str, dict]]) -> dict:
    """The manifest from every rank's entries plus meta.json (written by rank 0 just before).
    Refuses a folder holding a file nobody reported: the manifest must list every file."""
    files = {rel: entry for entries in per_rank for rel, entry in entries.items()}
    files[META] = file_entry(folder / META)
    on_disk = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()} - {MANIFEST}
    if on_disk != set(files):
        raise RuntimeError(f"checkpoint {folder}: files on disk {sorted(on_disk ^ set(files))} do "
                           "not match what the ranks reported writing")
    return {"version": 1, "files": dict(sorted(files.items()))}


def file_entry(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def verify_manifest(folder: Path, share: tuple[int, int] = (0, 1)) -> str | None:
    """None if every file listed exists with its size and checksum; else what is wrong.
    share=(i, n): check only the files at positions i, i+n, ... of the sorted list (one rank's
    share of a distributed check); the manifest itself is read by every share."""
    manifest_path = folder / MANIFEST
    if not manifest_path.exists():
        return f"checkpoint {folder} has no {MANIFEST}: it is incomplete or not a checkpoint"
    manifest = json.loads(manifest_path.read_text())
    index, count = share
    for rel, entry in sorted(manifest["files"].items())[index::count]:
        f = folder / rel
        if not f.exists():
            return f"checkpoint {folder} is missing {rel} (listed in {MANIFEST})"
        if f.stat().st_size != entry["bytes"]:
            return f"checkpoint file {f} has {f.stat().st_size} bytes, manifest says {entry['bytes']}"
        if sha256_file(f) != entry["sha256"]:
            return f"checkpoint file {f} fails its sha256 check (corrupted)"
    return None


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_torch_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
