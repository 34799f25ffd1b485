"""Prefetch: read, tokenize and pack in a background thread, `depth` micro-batches ahead.

Tokenizing a 128K-token micro-batch takes 0.4-1.3 s with a real-size BPE; in the training loop
that is 6-13% of a 7B step. Here a worker thread runs the loader (`next_windows()`:
the document groups go through `encode_batch`, which releases the GIL in the Rust tokenizer) and
builds the batch tensors, so the training loop only pops a finished batch.

Exactness: the worker's loader is ahead of the training loop by the queued batches. A checkpoint
therefore saves the loader's state *plus the queued batches' tokens* (as the loader state's
`replay` list; `state_dict()` pauses the worker between two batches to take both consistently).
On resume the loader hands the replayed batches out first, so the batches after a resume equal an
uninterrupted run's, with or without prefetch on either side. An error in the worker (bad data)
is raised in the training loop at the batch it would have produced. Imports threading and torch.

Pinning: for a CUDA run (`pins_batches`) the worker also pins the tensors the Trainer copies to
the device (`DEVICE_KEYS`), so its `non_blocking=True` copies (`batch_to_device`) are real
asynchronous DMA: from pageable memory CUDA first stages the bytes through a pinned driver buffer
on the calling thread. Pinning happens on the worker, off the training loop's critical path.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Mapping

import torch

from tsp_trainer.data.loader import PackedLoader
from tsp_trainer.data.packing import windows_tensor, windows_to_batch


DEVICE_KEYS = ("input_ids", "labels")   # copied to the device; document_ids are read on the host


def pins_batches(device: torch.device | str) -> bool:
    """Whether batches bound for `device` should be pinned: only a CUDA copy gains from it (a
    CPU run would only pay for page-locking)."""
    return torch.device(device).type == "cuda"


def pin_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch with its DEVICE_KEYS tensors in pinned host memory (the rest as they are)."""
    return {k: v.pin_memory() if k in DEVICE_KEYS else v for k, v in batch.items()}


def batch_to_device(batch: dict[str, torch.Tensor], device: torch.device) -> tuple[torch.Tensor, ...]:
    """(input_ids, labels) on `device`; non_blocking: from a pinned batch the copy is queued on
    the stream and the host does not wait for it (no sync)."""
    return tuple(batch[k].to(device, non_blocking=True) for k in DEVICE_KEYS)


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


class PrefetchLoader:
    """A PackedLoader whose next batches are prepared by a worker thread (same interface)."""

    def __init__(self, loader: PackedLoader, *, depth: int = 2, pin_memory: bool = False):
        if depth < 1:
            raise ValueError(f"data.prefetch={depth} must be >= 1 for a PrefetchLoader (0 = off)")
        self.loader, self.depth, self.pin_memory = loader, depth, pin_memory
        self._queue: deque = deque()                 # (batch, tokens (B, S+1), stats) or _Failure
        self._cond = threading.Condition()
        self._work = threading.Lock()                # held while the worker makes one batch
        self._thread: threading.Thread | None = None
        self._stop = False
        self.stats: dict[str, Any] = dict(loader.stats)   # of the batch last handed out

    # -- the worker -----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while len(self._queue) >= self.depth and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
            try:
                with self._work:
                    if self._stop:
                        return
                    tokens = windows_tensor(self.loader.next_windows())     # (B, S + 1)
                    batch = windows_to_batch(tokens, self.loader.document_eos)
                    item = (pin_batch(batch) if self.pin_memory else batch, tokens,
                            dict(self.loader.stats))
            except BaseException as exc:                 # handed to the training loop
                item = _Failure(exc)
            with self._cond:
                self._queue.append(item)
                self._cond.notify_all()
            if isinstance(item, _Failure):
                return

    def _start(self) -> None:
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._run, name="tsp-data-prefetch",
                                            daemon=True)
            self._thread.start()

    def _halt(self) -> None:
        """Stop the worker and drop what it queued (the caller restores or discards it)."""
        if self._thread is not None:
            with self._cond:
                self._stop = True
                self._cond.notify_all()
            self._thread.join()
            self._thread = None
        self._queue.clear()

    # -- the loader interface --------------------------------------------------------------------
    def __iter__(self) -> "PrefetchLoader":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        self._start()
        with self._cond:
            while not self._queue:
                self._cond.wait()
            item = self._queue.popleft()
            self._cond.notify_all()
        if isinstance(item, _Failure):
            self._thread = None      # the worker has ended; a load_state_dict() can restart it
            raise item.exc
        batch, _, self.stats = item
        return batch

    def describe(self) -> list[str]:
        pinned = " in pinned memory" if self.pin_memory else ""
        return self.loader.describe() + [f"data: a worker thread prepares {self.depth} "
                                         f"micro-batch(es) ahead{pinned} (data.prefetch)"]

    def state_dict(self) -> dict[str, Any]:
        """The loader's state with the queued batches' tokens in front of its replay list."""
        with self._work, self._cond:
            state = self.loader.state_dict()
            queued = [item[1].tolist() for item in self._queue if not isinstance(item, _Failure)]
        state["replay"] = queued + list(state["replay"])
        return state

    def load_state_dict(self, state: Mapping[str, Any], **kwargs) -> None:
        self._halt()
        self.loader.load_state_dict(state, **kwargs)
        self.stats = dict(self.loader.stats)

    def close(self) -> None:
        self._halt()
        self.loader.close()

    def __enter__(self) -> "PrefetchLoader":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
