"""Per-rank memory accounting for the benchmark.

State bytes (parameters, gradients, AdamW moments) are read off the tensors. Peak activation +
transient bytes come from `LiveTensorMemory`, a TorchDispatchMode that sees every tensor an op
returns, remembers each new storage's size and forgets it when the storage is freed (a weakref
callback), so `peak` is the high-water mark of bytes allocated inside the mode and still alive:
saved activations, transient buffers (gathered K/V, broadcast weight shards, logits blocks, the
communication buffers we allocate) and temporaries of gradient accumulation. It is the mechanism of
torch.distributed._tools.mem_tracker.MemTracker without the per-module bookkeeping; a unit test
checks that both report the same peak for a model step. Storages that exist before entering (the
parameters, preallocated gradients, the batch) must be passed to `ignore` so in-place updates of
them are not counted. Not seen: allocations inside a backend (gloo/NCCL scratch), the caching
allocator's rounding and fragmentation (on GPU use torch.cuda.max_memory_allocated instead).
"""

from __future__ import annotations

import weakref
from functools import partial

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary


class LiveTensorMemory(TorchDispatchMode):
    """High-water mark of bytes in storages created inside the mode (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.marks: dict[str, int] = {}       # bytes alive at named points (e.g. end of forward)
        self._seen = WeakIdKeyDictionary()    # storage -> (nbytes, weakref with free callback)

    def ignore(self, *tensors) -> None:
        """Mark storages that already exist (parameters, grads, inputs) as not allocated here;
        anything that is not a tensor (None, PositionRuns) is skipped."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._seen[t.untyped_storage()] = (0, None)

    def mark(self, name: str) -> None:
        self.marks[name] = self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t.untyped_storage())
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        if storage in self._seen:
            return
        nbytes = storage.nbytes()
        self._seen[storage] = (nbytes, weakref.ref(storage, partial(self._free, nbytes)))
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def _free(self, nbytes: int, _ref) -> None:
        self.live -= nbytes


def tensor_bytes(tensors) -> int:
    """Bytes of distinct storages among `tensors` (tied weights counted once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Per-rank parameter, gradient and optimizer-state bytes (after at least one step)."""
    params = list(model.parameters())
    opt = [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return {"param_bytes": tensor_bytes(params), "grad_bytes": tensor_bytes(p.grad for p in params),
            "optim_bytes": tensor_bytes(opt)}
