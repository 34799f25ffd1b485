"""`tsp-train convert-checkpoint PATH`: rewrite the rank state files of checkpoints saved in the
older format (the NumPy RNG state pickled as a numpy array) in the current one, which a resume
reads as plain data (checkpoint/rank_file.py). A one-off the user runs on a checkpoint they trust.

PATH: a step_* folder, or a checkpoints root / run folder (every complete checkpoint in it). Each
checkpoint must verify (manifest sizes and sha256) first. Its old rank state files are read with
torch.load(weights_only=True), allowing numpy's array globals and nothing else: a file that needs
anything more is refused, naming it, and nothing from it runs. The converted checkpoint is built
next to the original (its other files hard-linked, the manifest updated) and swapped in with two
renames; a checkpoint already in the current format is left as it is. Exit 2 with one line on
stderr for bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

from tsp_trainer.checkpoint.disk_format import (MANIFEST, atomic_torch_save, atomic_write_text,
                                                file_entry, fsync_dir, verify_manifest)
from tsp_trainer.checkpoint.rank_file import RankStateRefused, read_rank_state
from tsp_trainer.checkpoint.train_state import pack_rank_state

# The older format's numpy globals, under numpy 2's names and numpy 1's.
_OLDER_FORMAT_SAFE = [np.ndarray, np.dtype, np.dtypes.UInt32DType, np._core.multiarray._reconstruct,
                      (np._core.multiarray._reconstruct, "numpy.core.multiarray._reconstruct")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tsp-train convert-checkpoint",
        description="Rewrite the rank state files of checkpoints saved in the older format (a numpy "
                    "RNG state) in the current one, which train.resume reads as plain data. Run it "
                    "only on checkpoints you trust.")
    parser.add_argument("path", help="a step_* folder, or a checkpoints root / run folder (every "
                                     "complete checkpoint in it)")
    args = parser.parse_args(argv)
    try:
        for folder in checkpoints_to_convert(args.path):
            converted = convert_checkpoint(folder)
            print(f"tsp-train: {folder}: " + (f"{converted} rank state file(s) converted, manifest "
                                              "updated" if converted else "already in the current format"))
    except ValueError as err:
        print(f"tsp-train convert-checkpoint: error: {err}", file=sys.stderr)
        return 2
    return 0


def checkpoints_to_convert(path: str | os.PathLike) -> list[Path]:
    path = Path(path)
    if (path / MANIFEST).exists():
        return [path]
    for root in (path, path / "checkpoints"):
        found = sorted(p for p in root.glob("step_*") if (p / MANIFEST).exists()) if root.is_dir() else []
        if found:
            return found
    raise ValueError(f"{path} is neither a checkpoint (a step_* folder with {MANIFEST}) nor a "
                     "checkpoints root or run folder holding one")


def convert_checkpoint(folder: Path) -> int:
    """Convert one verified checkpoint in place; returns how many rank state files were rewritten."""
    if (problem := verify_manifest(folder)) is not None:
        raise ValueError(f"{problem}; only a checkpoint that verifies is converted")
    old = [p for p in sorted(folder.glob("ranks/rank_*.pt")) if _older_format(p)]
    if not old:
        return 0
    work = folder.with_name(f".{folder.name}.converting")
    shutil.rmtree(work, ignore_errors=True)
    manifest = json.loads((folder / MANIFEST).read_text())
    for f in (p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST and p not in old):
        target = work / f.relative_to(folder)
        target.parent.mkdir(parents=True, exist_ok=True)
        _link_or_copy(f, target)
    for path in old:
        rel = str(path.relative_to(folder))
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        atomic_torch_save(_converted(path), work / rel)
        manifest["files"][rel] = file_entry(work / rel)
    atomic_write_text(work / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
    fsync_dir(work)
    replaced = folder.with_name(f".{folder.name}.replaced")
    shutil.rmtree(replaced, ignore_errors=True)
    os.rename(folder, replaced)             # never delete first: swap, then remove the old one
    os.rename(work, folder)
    shutil.rmtree(replaced, ignore_errors=True)
    fsync_dir(folder.parent)
    return len(old)


def _older_format(path: Path) -> bool:
    try:
        read_rank_state(path)
    except RankStateRefused as err:
        if err.older_format:
            return True
        raise ValueError(f"{err}; nothing converted") from None
    return False


def _converted(path: Path) -> dict:
    """An older-format rank state in the current form: torch.load(weights_only=True) with numpy's
    array globals allowed (read_rank_state already found no other global in it)."""
    with torch.serialization.safe_globals(_OLDER_FORMAT_SAFE):
        old = torch.load(path, map_location="cpu", weights_only=True)
    rng = dict(old["rng"])
    name, key, pos, has_gauss, gauss = rng["numpy"]       # np.random.get_state()'s legacy tuple
    rng["numpy"] = {"bit_generator": name, "state": {"key": key, "pos": pos},
                    "has_gauss": has_gauss, "gauss": gauss}
    return pack_rank_state(old["loader"], old["scheduler"], rng)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:                          # another file system, or no hard links there
        shutil.copy2(src, dst)
