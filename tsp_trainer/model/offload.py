"""Activation offload (`train.offload_activations`): what each decoder block saves for its backward
moves to host memory during the forward and comes back during the backward, one block ahead
(`train.offload_prefetch`) or when the block's backward asks for it.

A `block_wrapper` (model/transformer.py) runs each block, plain or checkpointed, under
`saved_tensors_hooks`; parameters and their views stay where they are, and nothing in parallel/
changes (the hooks see what the TSP functions chose to save). On CUDA the copies run on a side
stream into pinned memory; on CPU the same code path makes real host copies (exact:
tests/distributed/test_offload.py).

In backward, at the first unpack of a block's saved tensors: with prefetch the previous block's
are all fetched too, so two blocks' saved tensors are on the GPU while a block is backpropagated
and the next block's copy hides behind its compute; without it a block's tensors come back only
when its own backward unpacks them, one block's on the GPU at a time, each copy exposed (a
block input at 10M tokens over 8 GPUs is 10 GB: about 0.2 s of PCIe against minutes of compute).

Nested checkpointing (model/activation_checkpoint.py `checkpointed_segment`) keeps one input per
segment in a block's store and puts the inner block inputs its backward regains into `stash`
stores of their own (host memory, the same copies), each fetched back for its own block's
backward, so nesting holds no more block inputs on the GPU than per-block checkpointing.
"""

from __future__ import annotations

import torch
import torch.nn as nn


class ActivationOffload:
    """block_wrapper(block, x, rope) that offloads the block's saved tensors; `inner` is the
    wrapper it wraps (e.g. activation checkpointing) or None."""

    def __init__(self, inner=None, *, prefetch: bool = True, hands_store: bool = False):
        """prefetch: train.offload_prefetch (module docstring). hands_store: `inner` takes the
        call's store as `host=` (checkpointed_segment: the segment input it keeps and regains from)."""
        self.inner = inner
        self.prefetch_next = prefetch
        self.hands_store = hands_store
        self._order: dict[int, int] = {}            # id(block) -> its index in forward order
        self._stores: dict[int, _BlockStore] = {}   # index -> the latest forward's saved tensors
        self._stashes: list[_BlockStore] = []       # stores of regained inner inputs (nesting)
        self._stream = None

    def __call__(self, block: nn.Module, x: torch.Tensor, rope):
        if not torch.is_grad_enabled():
            return self._run(block, x, rope)
        index = self._order.setdefault(id(block), len(self._order))
        store = _BlockStore(self, index, x.device)
        self._stores[index] = store
        self._stashes = [s for s in self._stashes if s.host_bytes]   # the last forward's are spent
        with torch.autograd.graph.saved_tensors_hooks(store.pack, store.unpack):
            return self._run(block, x, rope, store)

    def _run(self, block, x, rope, store=None):
        if self.inner is None:
            return block(x, rope)
        if self.hands_store and store is not None:
            return self.inner(block, x, rope, host=store)
        return self.inner(block, x, rope)

    def stash(self, device: torch.device) -> "_BlockStore":
        """A store outside the chain of blocks (no prefetch of a previous block from it) for
        tensors made in backward: the inner block inputs a segment's re-run regains."""
        store = _BlockStore(self, None, device)
        self._stashes.append(store)
        return store

    def side_stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def prefetch(self, index: int | None) -> None:
        store = self._stores.get(index) if self.prefetch_next and index is not None else None
        if store is not None:
            store.fetch_all()

    @property
    def host_bytes(self) -> int:
        """Bytes currently held in host memory (for tests and benchmarks)."""
        return sum(s.host_bytes for s in (*self._stores.values(), *self._stashes))

    @property
    def fetched_bytes(self) -> int:
        """Bytes fetched back to the device and not yet handed to a backward (prefetched copies)."""
        return sum(s.fetched_bytes for s in (*self._stores.values(), *self._stashes))


def _is_parameter(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)


class _BlockStore:
    """The saved tensors of one block's forward: host copies, and device copies once fetched."""

    def __init__(self, owner: ActivationOffload, index: int | None, device: torch.device):
        self.owner, self.index, self.device = owner, index, device
        self.host: list[torch.Tensor] = []
        self.ready: list = []                     # per tensor: CUDA event of the host copy (or None)
        self.fetched: dict[int, tuple[torch.Tensor, object]] = {}   # slot -> (device copy, event)
        self.started_prefetch = False

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.host if t is not None)

    @property
    def fetched_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t, _ in self.fetched.values())

    def pack(self, t: torch.Tensor):
        # parameters stay where they are; a host tensor saved by a GPU block (an index or a scalar
        # made on the CPU) is already where the offload would put it
        if _is_parameter(t) or t.numel() == 0 or (t.device.type == "cpu" and self.device.type != "cpu"):
            return ("kept", t)
        stream = self.owner.side_stream(t.device)
        if stream is None:                        # CPU: a separate host buffer, copied now
            host = torch.empty(t.shape, dtype=t.dtype, layout=t.layout)
            host.copy_(t)
            event = None
        else:                                     # CUDA: pinned memory, copied on the side stream
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                host.copy_(t, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            t.record_stream(stream)               # the device memory is reused only after the copy
        self.host.append(host)
        self.ready.append(event)
        return ("host", len(self.host) - 1, t.device)

    def unpack(self, packed):
        if packed[0] == "kept":
            return packed[1]
        if not self.started_prefetch:             # first unpack of this block in backward
            self.started_prefetch = True
            self.owner.prefetch(None if self.index is None else self.index - 1)
        dev = self._take(packed[1])
        self.host[packed[1]] = None               # one backward unpacks each saved tensor once
        return dev

    def peek(self, packed) -> torch.Tensor:
        """A device copy of a packed tensor that leaves the host copy for its own unpack (a
        segment's re-run reads the segment input its first block's backward unpacks later); it
        starts no prefetch, and takes the prefetched copy when there is one."""
        return packed[1] if packed[0] == "kept" else self._take(packed[1])

    def fetch(self, packed) -> None:
        """Start fetching one packed tensor back to the device (a stash's next inner input)."""
        if packed[0] == "host" and self.host[packed[1]] is not None:
            self._fetch(packed[1])

    def _take(self, slot: int) -> torch.Tensor:
        self._fetch(slot)
        dev, event = self.fetched.pop(slot)
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            dev.record_stream(current)
        return dev

    def fetch_all(self) -> None:
        self.started_prefetch = True
        for slot, host in enumerate(self.host):
            if host is not None:
                self._fetch(slot)

    def _fetch(self, slot: int) -> None:
        if slot in self.fetched:
            return
        host = self.host[slot]
        if host is None:
            raise RuntimeError("train.offload_activations: a saved tensor was unpacked twice (a second "
                               "backward through the same graph, retain_graph=True): not supported")
        stream = self.owner.side_stream(self.device)
        if stream is None:
            dev = torch.empty_like(host)
            dev.copy_(host)
            self.fetched[slot] = (dev, None)
            return
        with torch.cuda.stream(stream):
            if self.ready[slot] is not None:
                stream.wait_event(self.ready[slot])
            dev = host.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        self.fetched[slot] = (dev, event)
