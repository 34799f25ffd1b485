"""The policy of a run's checkpoints folder: how a save is published, which checkpoints are kept,
which one a resume reads. The files themselves are checkpoint/disk_format.py's.

Publication: all ranks write into `.step_00000020.tmp`; when every rank has finished, rank 0
writes meta.json and the manifest (merged from the entries each rank hashed while writing, so no
rank hashes the whole checkpoint), renames the folder to its final name, and only then moves
`latest` (os.replace). A crash at any point leaves `latest` naming the previous complete
checkpoint; stale temporaries are removed by the next save. Which checkpoint a resume reads, and
its verification (sizes and checksums, once, on global rank 0 before the process groups exist), is
checkpoint/fallback.py's; pruning never sees the damaged ones it sets aside (<root>/damaged/).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from tsp_trainer.checkpoint.disk_format import (LATEST, MANIFEST, META, atomic_torch_save, atomic_write_text,
                                                file_entry, fsync_dir, latest_checkpoint,
                                                merged_manifest, rank_state_name, step_dir_name)
from tsp_trainer.checkpoint.rank_file import read_rank_state
from tsp_trainer.parallel.comm import Comm


class CheckpointStore:
    """The checkpoints folder of one run, shared by every rank: temporary folders, publication,
    keep-last-K pruning, and reading a checkpoint to resume.

    Args:
        root: the run's checkpoints folder (<output_dir>/checkpoints).
        world: a Comm over every rank (barriers, the hash gather).
        keep_last: complete checkpoints kept after each publish (0: all).
    """

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
        rel = rank_state_name(self.world.rank)
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
            manifest = merged_manifest(tmp, entries)
            atomic_write_text(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
            fsync_dir(tmp)
            old = final.with_name(f".{final.name}.replaced") if final.exists() else None
            if old is not None:           # re-saving a step: swap folders, never delete first
                shutil.rmtree(old, ignore_errors=True)
                os.rename(final, old)
            os.rename(tmp, final)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            fsync_dir(self.root)
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

    def read_meta(self, path: Path) -> dict:
        """meta.json of a checkpoint rank 0 has verified (checkpoint/fallback.py, run/inputs.py)."""
        return json.loads((Path(path) / META).read_text())

    def read_rank_state(self, path: Path, rank: int | None = None) -> dict:
        """This rank's state, or saved rank `rank`'s (a resume under another layout), read without
        running anything from the file (checkpoint/rank_file.py; rank 0 read every rank's file
        the same way before the process groups existed)."""
        rank = self.world.rank if rank is None else rank
        return read_rank_state(path / rank_state_name(rank))
