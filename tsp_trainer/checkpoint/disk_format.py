"""The on-disk format of a checkpoint folder: its names, the manifest that proves it complete,
and the atomic writes it is made of. No policy (when to save, what to keep: checkpoint/store.py).

    <root>/step_00000020/
        model/model-tspXXX-of-YYY[-partPPP-of-QQQ].safetensors  model shards (checkpoint/shards.py)
        optim/optim-tspXXX-of-YYY[-partPPP-of-QQQ].safetensors  optimizer state (checkpoint/reshard.py)
        ranks/rank_XXXXX.pt               per-rank state: data loader, RNG, scheduler
        meta.json                         step, tokens seen, layout, model config, resolved config
        manifest.json                     every file with its size and sha256 (written last)
    <root>/latest                         name of the newest complete checkpoint
    <root>/damaged/step_00000060          a checkpoint that failed verification, set aside
                                          (checkpoint/fallback.py); never pruned or resumed

A folder is complete when its manifest exists: the manifest is written last, so a folder without
one is a save that did not finish (or not a checkpoint). Verifying a folder checks every listed
file's size and sha256.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

LATEST = "latest"
MANIFEST = "manifest.json"
META = "meta.json"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def rank_state_name(rank: int) -> str:
    """A rank's file inside a checkpoint folder (data loader, LR scheduler, RNG)."""
    return f"ranks/rank_{rank:05d}.pt"


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
    error = verify_manifest(folder)
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


def merged_manifest(folder: Path, per_rank: list[dict[str, dict]]) -> dict:
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


def verify_manifest(folder: Path, *, workers: int | None = None) -> str | None:
    """None if every file listed exists with its size and checksum; else one line naming the file
    and what is wrong with it (missing, truncated or of another size, failed sha256), or the
    manifest (absent, unreadable). Sizes are checked first (no reading); then `workers` threads
    hash the files (hashlib releases the GIL: the files are read and hashed in parallel)."""
    folder = Path(folder)
    manifest_path = folder / MANIFEST
    if not manifest_path.exists():
        return f"checkpoint {folder} has no {MANIFEST}: it is incomplete or not a checkpoint"
    try:    # [(relative path, bytes, sha256)], sorted
        files = [(rel, int(e["bytes"]), str(e["sha256"]))
                 for rel, e in sorted(json.loads(manifest_path.read_text())["files"].items())]
    except (ValueError, KeyError, TypeError, AttributeError) as err:   # JSONDecodeError: ValueError
        return f"checkpoint {folder} has an unreadable {MANIFEST} ({err!r})"
    for rel, size, _ in files:
        if (problem := _size_problem(folder, rel, size)) is not None:
            return problem
    workers = workers or min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        digests = list(pool.map(lambda item: sha256_file(folder / item[0]), files))
    for (rel, _, sha256), digest in zip(files, digests):
        if digest != sha256:
            return f"checkpoint file {folder / rel} fails its sha256 check (corrupted)"
    return None


def _size_problem(folder: Path, rel: str, expected: int) -> str | None:
    f = folder / rel
    if not f.is_file():
        return f"checkpoint {folder} is missing {rel} (listed in {MANIFEST})"
    size = f.stat().st_size
    if size < expected:
        return f"checkpoint file {f} is truncated: {size} bytes, {MANIFEST} says {expected}"
    if size > expected:
        return f"checkpoint file {f} has {size} bytes, {MANIFEST} says {expected}"
    return None


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with naming_the_file(tmp), open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_torch_save(obj, path: Path) -> None:
    """torch.save through a memory buffer, then plain writes: torch's zip writer, writing to a file,
    turns a full disk into "unexpected pos 64 vs 0" (or an iostream error) and loses the errno; a
    plain write raises the OSError itself (ENOSPC, EDQUOT, EIO), here with the file's path.
    Per-rank state is small (loader, RNG, scheduler), so the buffer costs nothing."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    tmp = path.with_name(path.name + ".tmp")
    with naming_the_file(tmp), open(tmp, "wb") as f:
        f.write(buffer.getbuffer())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@contextlib.contextmanager
def naming_the_file(path: Path):
    """An OSError raised inside names `path`: a failed write() or fsync() names no file, so a
    full disk would be reported as "[Errno 28] No space left on device" without saying where."""
    try:
        yield
    except OSError as err:
        if err.filename is None and err.errno is not None:
            raise OSError(err.errno, err.strerror, str(path)) from err
        raise


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def folder_bytes(folder: Path) -> int:
    """Bytes of every file in a checkpoint folder (its size on disk, manifest included)."""
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
