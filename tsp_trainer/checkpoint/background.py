"""The background half of an async save (`checkpoint.async_save`): host staging of the live
tensors and the writer thread. CheckpointWriter (checkpoint/writer.py) runs the same WriteJob
inline for a synchronous save.

    copy    the writer thread first copies the live tensors (weights, moments) into the staging
            buffers, while the training thread runs the next forward/backward, which read them
            but do not change them (on GPU: device-to-host copies on the stream, waited for by an
            event). CheckpointWriter.before_update(), called right before each optimizer step,
            waits until the copies are done: only the update changes those tensors.
    write   the same thread writes this rank's files into the temporary folder and hashes them as
            it writes (shards.save_safetensors); no collective, nothing published.

The writer thread never communicates; every collective runs on the training thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from tsp_trainer.checkpoint.reshard import ShardFile


class HostStaging:
    """Host copies for an async snapshot, kept from save to save (one save in flight at a time, so
    the previous save's buffers are free again). Buffers are pinned when the source is on a GPU
    and `pinned` (checkpoint.pinned_staging): only a copy into pinned memory is asynchronous.
    With pinned=False they are pageable: the device-to-host copy then returns only when done (the
    training thread waits for it at the snapshot), and no page-locked RAM is held between saves
    (a container's memory limit counts page-locked pages, and they can never be swapped out).

    kind "live" (host): the copy is deferred to the writer thread (`complete()`), overlapping the
    next forward/backward; "scratch" (a buffer the snapshot reuses): copied now; GPU tensors: a
    non-blocking copy now, and `complete()` waits for an event recorded after the last one."""

    def __init__(self, *, pinned: bool = True) -> None:
        self.pinned = pinned
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
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pins(t))
            self._buffers[name] = buf
        self.copied.clear()
        if kind == "live" and not t.is_cuda:
            self._deferred.append((buf, t.detach()))
        else:
            buf.copy_(t.detach(), non_blocking=t.is_cuda)
            self._pending_cuda |= t.is_cuda
        return buf

    def pins(self, t: torch.Tensor) -> bool:
        """Whether the staging buffer of `t` is page-locked: a GPU source, and pinning on."""
        return t.is_cuda and self.pinned

    @property
    def bytes_held(self) -> int:
        """Host bytes of the staging buffers kept between saves."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

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
class Snapshot:
    """Everything one rank writes for one checkpoint, already detached from training."""

    files: list[ShardFile]             # model/ and optim/ shards this rank writes
    rank_state: dict                   # ranks/rank_XXXXX.pt: loader, scheduler, RNG
    meta: dict                         # meta.json (rank 0's is written)


@dataclass
class WriteJob:
    """One rank's write of one checkpoint: run() inline (sync) or start() on a thread (async)."""

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
