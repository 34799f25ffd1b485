"""Saving a checkpoint in three phases, so that training need not wait for the disk:
snapshot, write (in the background with `checkpoint.async_save`), publish last.

    save(step)   training thread, collective. First finishes the save in flight, if any: at most
                 one save is ever in flight. Then the temporary folder (CheckpointManager.begin)
                 and the snapshot: this rank's share of the state staged for host memory (pinned
                 buffers on GPU, reused from save to save) plus its per-rank state (copied now).
                 Then the write starts: on a background thread with async_save, inline otherwise.
    copy         (async) the writer thread first copies the live tensors (weights, moments) into
                 the staging buffers, while the training thread runs the next forward/backward,
                 which read them but do not change them (on GPU: device-to-host copies on the
                 stream, waited for by an event). before_update(), called by the Trainer right
                 before each optimizer step, waits until the copies are done: only the update
                 changes those tensors.
    write        each rank writes its files into the temporary folder and hashes them as it
                 writes (shards.save_safetensors); no collective, nothing published.
    poll()       training thread, collective, once per step while a save is in flight: the ranks
                 agree with one small MAX all-reduce whether every write is complete (or failed).
    publish      when all are complete: rank 0 merges the ranks' file hashes into the manifest,
                 renames the folder and moves `latest` (CheckpointManager.publish). A kill at any
                 earlier point leaves `latest` on the previous checkpoint, and the next save removes
                 the temporary folder. A failed write on any rank is raised on every rank as
                 CheckpointSaveError, and the temporary folder is removed.
    wait()       training thread, collective: finish the save in flight (end of fit, before exit).

The writer thread never communicates; every collective runs on the training thread at a step
boundary, in the same order on every rank.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from tsp_trainer.checkpoint.manager import CheckpointManager
from tsp_trainer.checkpoint.reshard import HostCopy, ShardFile


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written; the previous complete one stays `latest`."""


@dataclass
class Snapshot:
    """Everything one rank writes for one checkpoint, already detached from training."""

    files: list[ShardFile]             # model/ and optim/ shards this rank writes
    rank_state: dict                   # ranks/rank_XXXXX.pt: loader, scheduler, RNG
    meta: dict                         # meta.json (rank 0's is written)


class HostStaging:
    """Host copies for an async snapshot, kept from save to save (one save in flight at a time, so
    the previous save's buffers are free again). Buffers are pinned when the source is on a GPU
    (a non-blocking device-to-host copy needs pinned memory).

    kind "live" (host): the copy is deferred to the writer thread (`complete()`), overlapping the
    next forward/backward; "scratch" (a buffer the snapshot reuses): copied now; GPU tensors: a
    non-blocking copy now, and `complete()` waits for an event recorded after the last one."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._deferred: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._pending_cuda = False          # non-blocking device-to-host copies issued
        self._cuda_event = None
        self.copied = threading.Event()
        self.copied.set()

    def __call__(self, name: str, t: torch.Tensor, kind: str) -> torch.Tensor:
        if kind == "fresh" and not t.is_cuda:     # a new host tensor nothing else writes: keep it
            return t
        buf = self._buffers.get(name)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            self._buffers[name] = buf
        self.copied.clear()
        if kind == "live" and not t.is_cuda:
            self._deferred.append((buf, t.detach()))
        else:
            buf.copy_(t.detach(), non_blocking=t.is_cuda)
            self._pending_cuda |= t.is_cuda
        return buf

    def staged(self) -> None:
        """Training thread, after the snapshot: mark where the GPU copies end on the stream."""
        if self._pending_cuda:
            self._cuda_event = torch.cuda.Event()
            self._cuda_event.record()
            self._pending_cuda = False

    def complete(self) -> None:
        """Writer thread: finish every copy; then the live tensors may change again."""
        try:
            for buf, live in self._deferred:
                buf.copy_(live)
            if self._cuda_event is not None:
                self._cuda_event.synchronize()
        finally:
            self._deferred, self._cuda_event = [], None
            self.copied.set()


@dataclass
class _WriteJob:
    step: int
    tmp: Path
    snapshot: Snapshot
    write: Callable[[Path, Snapshot], dict[str, dict]]
    files: dict[str, dict] = field(default_factory=dict)     # rel -> {bytes, sha256}
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    staging: HostStaging | None = None

    def run(self) -> None:
        try:
            if self.staging is not None:
                self.staging.complete()
            self.files = self.write(self.tmp, self.snapshot)
        except BaseException as err:                # reported at the next collective check
            self.error = err
        finally:
            self.snapshot.files = []                # drop references to the host copies
            self.done.set()

    def start(self) -> None:
        # A daemon thread: a process that exits (or is killed) mid-write never publishes it.
        self.thread = threading.Thread(target=self.run, name=f"checkpoint-writer-{self.step}",
                                       daemon=True)
        self.thread.start()


class Checkpointer:
    """The Trainer's one checkpoint object: save(), poll() every step, wait() at the end.

    Args:
        manager: the CheckpointManager (temporary folder, per-rank file, publish, prune).
        world: a Comm over every rank (the agreement all-reduce, the hash gather).
        async_save: write on a background thread (checkpoint.async_save).
        device: where the agreement flag lives (the compute device: NCCL serves no CPU tensors).
    """

    def __init__(self, manager: CheckpointManager, *, world, async_save: bool, device: torch.device):
        self.manager, self.world, self.async_save, self.device = manager, world, async_save, device
        self.staging = HostStaging() if async_save else None
        self._job: _WriteJob | None = None
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
            tmp = self.manager.begin(step)
            snap = snapshot(self.staging)
            if self.staging is not None:
                snap.rank_state = copy.deepcopy(snap.rank_state)
                self.staging.staged()
            self._job = _WriteJob(step, tmp, snap, self._write, staging=self.staging)
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
            files.update(shard.write(tmp))
        files.update(self.manager.write_rank_state(tmp, snap.rank_state))
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
            return self.manager.publish(job.tmp, job.step, job.snapshot.meta, files=job.files)
        mine = None
        if job.error is not None:        # OSError's text already says what it is
            mine = str(job.error) if isinstance(job.error, OSError) else f"{type(job.error).__name__}: {job.error}"
        reports = self.world.all_gather_object(mine)
        if self.world.rank == 0:
            self.manager.abort(job.tmp)
        self.world.barrier()
        rank = next(r for r, text in enumerate(reports) if text)
        raise CheckpointSaveError(
            f"saving the step-{job.step} checkpoint failed on rank {rank}: {reports[rank]}; "
            f"{self.manager.latest()} is still the latest complete checkpoint") from job.error
