"""Writing a checkpoint in three phases, so that training need not wait for the disk: snapshot,
write (in the background with `checkpoint.async_save`, checkpoint/background.py), publish last.

    save(step)   training thread, collective. First finishes the save in flight, if any: at most
                 one save is ever in flight. Then the temporary folder (CheckpointStore.begin)
                 and the snapshot: this rank's share of the state staged for host memory (pinned
                 buffers on GPU, reused from save to save) plus its per-rank state (copied now).
                 Then the write: on the background thread with async_save, inline otherwise
                 (published before save() returns).
    poll()       training thread, collective, once per step while a save is in flight: the ranks
                 agree with one small MAX all-reduce whether every write is complete (or failed).
    publish      when all are complete: rank 0 merges the ranks' file hashes into the manifest,
                 renames the folder and moves `latest` (CheckpointStore.publish). A kill at any
                 earlier point leaves `latest` on the previous checkpoint, and the next save removes
                 the temporary folder. A failed write on any rank is raised on every rank as
                 CheckpointSaveError, and the temporary folder is removed.
    wait()       training thread, collective: finish the save in flight (end of fit, before exit).

Every collective runs on the training thread at a step boundary, in the same order on every rank.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Callable

import torch

from tsp_trainer.checkpoint.background import HostStaging, Snapshot, WriteJob
from tsp_trainer.checkpoint.disk_format import naming_the_file
from tsp_trainer.checkpoint.reshard import HostCopy
from tsp_trainer.checkpoint.store import CheckpointStore


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written; the previous complete one stays `latest`. Raised on every
    rank; `seen_here` is true on the ranks whose own write failed (the message is then theirs), so
    the CLI reports the cause once from each of them, not one traceback per rank."""

    def __init__(self, message: str, *, seen_here: bool):
        super().__init__(message)
        self.seen_here = seen_here


class CheckpointWriter:
    """save(), poll() every step, wait() at the end; each published checkpoint is reported to
    `on_publish(step, folder)` on every rank.

    Args:
        store: the CheckpointStore (temporary folder, per-rank file, publish, prune).
        world: a Comm over every rank (the agreement all-reduce, the hash gather).
        async_save: write on a background thread (checkpoint.async_save).
        pinned_staging: its host staging of GPU tensors is pinned (checkpoint.pinned_staging).
        device: where the agreement flag lives (the compute device: NCCL serves no CPU tensors).
    """

    def __init__(self, store: CheckpointStore, *, world, async_save: bool, device: torch.device,
                 on_publish: Callable[[int, Path], None] | None = None, pinned_staging: bool = True):
        self.store, self.world, self.async_save, self.device = store, world, async_save, device
        self.on_publish = on_publish
        self.staging = HostStaging(pinned=pinned_staging) if async_save else None
        self._job: WriteJob | None = None
        self._stall_s = 0.0

    @property
    def in_flight(self) -> bool:
        return self._job is not None

    def take_stall_s(self) -> float:
        """Seconds the training thread spent in save/poll/wait since the last call."""
        stall, self._stall_s = self._stall_s, 0.0
        return stall

    def save(self, step: int, snapshot: Callable[[HostCopy | None], Snapshot]) -> None:
        """Collective. `snapshot(host_copy)` returns this rank's Snapshot (itself collective)."""
        start = time.perf_counter()
        try:
            self._finish()                          # at most one save in flight
            tmp = self.store.begin(step)
            snap = snapshot(self.staging)
            if self.staging is not None:
                snap.rank_state = copy.deepcopy(snap.rank_state)
                self.staging.staged()
            self._job = WriteJob(step, tmp, snap, self._write, staging=self.staging)
            if self.async_save:
                self._job.start()
            else:
                self._job.run()
                self._finish()
        finally:
            self._stall_s += time.perf_counter() - start

    def before_update(self) -> None:
        """Training thread, right before each optimizer step: wait until the save in flight has
        copied the tensors the update is about to change (usually done during forward/backward)."""
        if self.staging is not None and not self.staging.copied.is_set():
            start = time.perf_counter()
            self.staging.copied.wait()
            self._stall_s += time.perf_counter() - start

    def poll(self) -> Path | None:
        """Collective, at a step boundary: publish the save in flight if every rank's write is
        complete; returns the published folder, or None."""
        if self._job is None:
            return None
        start = time.perf_counter()
        try:
            not_done, failed = self._agree(not self._job.done.is_set())
            return None if not_done else self._publish_or_raise(failed)
        finally:
            self._stall_s += time.perf_counter() - start

    def wait(self) -> Path | None:
        """Collective: finish (publish or raise) the save in flight; returns the published folder."""
        start = time.perf_counter()
        try:
            return self._finish()
        finally:
            self._stall_s += time.perf_counter() - start

    # -- inside ----------------------------------------------------------------------------------
    def _write(self, tmp: Path, snap: Snapshot) -> dict[str, dict]:
        """Writer thread (or inline): this rank's files into `tmp`; their manifest entries."""
        files: dict[str, dict] = {}
        for shard in snap.files:
            with naming_the_file(tmp / shard.rel):
                files.update(shard.write(tmp))
        files.update(self.store.write_rank_state(tmp, snap.rank_state))
        return files

    def _finish(self) -> Path | None:
        if self._job is None:
            return None
        if self._job.thread is not None:
            self._job.thread.join()
        _, failed = self._agree(False)
        return self._publish_or_raise(failed)

    def _agree(self, not_done: bool) -> tuple[bool, bool]:
        """(any rank still writing, any rank failed), the same answer on every rank."""
        flags = torch.tensor([float(not_done), float(self._job.error is not None)], device=self.device)
        self.world.all_reduce(flags, tag="checkpoint.agree", op=torch.distributed.ReduceOp.MAX)
        not_done_any, failed_any = flags.tolist()
        return bool(not_done_any), bool(failed_any)

    def _publish_or_raise(self, failed: bool) -> Path:
        job, self._job = self._job, None
        if not failed:
            folder = self.store.publish(job.tmp, job.step, job.snapshot.meta, files=job.files)
            if self.on_publish is not None:
                self.on_publish(job.step, folder)
            return folder
        mine = None
        if job.error is not None:        # OSError's text already says what it is
            mine = str(job.error) if isinstance(job.error, OSError) else f"{type(job.error).__name__}: {job.error}"
        reports = self.world.all_gather_object(mine)
        if self.world.rank == 0:
            self.store.abort(job.tmp)
        self.world.barrier()
        rank = self.world.rank if mine else next(r for r, text in enumerate(reports) if text)
        raise CheckpointSaveError(
            f"saving the step-{job.step} checkpoint failed on rank {rank}: {reports[rank]}; "
            f"{self.store.latest()} is still the latest complete checkpoint",
            seen_here=mine is not None) from job.error
