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

Tensors handed to a collective: gloo's Work keeps references to them, and a worker thread drops
its own a moment after the op has completed. A storage the program had already let go of would be
freed then, on that thread, before or after the program's next allocation as the threads happen to
run, and the peak would change by its size from run to run. So the mode hands every gloo op
private aliases of its tensors (the backend's references are then to those) and holds them until
the op has completed and the program no longer holds its Work; it then waits for the backend to
let go of the aliases and drops them, on this thread, before the next op runs. A storage is thus
freed at the same point of the program in nearly every run. What the mode cannot see: a hold
gloo keeps on a tensor's storage other than through the aliases (its worker thread may drop it
just after the op completed). On a loaded machine a storage that went through a collective is then
now and then freed on that thread, a few ops later than in other runs, and `live` at a point in
between is larger by its size (seen: a 256-byte fp32 [h] gradient after its all-reduce).
"""

from __future__ import annotations

import sys
import time
import weakref
from functools import partial

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.weak import WeakIdKeyDictionary


class LiveTensorMemory(TorchDispatchMode):
    """High-water mark of bytes in storages created inside the mode (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.marks: dict[str, int] = {}       # bytes alive at named points (e.g. end of forward)
        self._seen = WeakIdKeyDictionary()    # storage -> (nbytes, weakref with free callback)
        self._lent: list[tuple] = []          # (Work, aliases of its tensors) per c10d op in flight

    def ignore(self, *tensors) -> None:
        """Mark storages that already exist (parameters, grads, inputs) as not allocated here;
        anything that is not a tensor (None, PositionRuns) is skipped."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._seen[t.untyped_storage()] = (0, None)

    def mark(self, name: str) -> None:
        self.marks[name] = self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._take_back_lent()
        if func.namespace == "c10d" and _on_gloo(args):
            return self._lend(func, args, kwargs or {})
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

    def _lend(self, func, args, kwargs):
        """Run a c10d op on private aliases of its tensors and keep them with the op's Work."""
        from torch.distributed.distributed_c10d import Work

        aliases = []

        def alias(x):
            if isinstance(x, torch.Tensor):
                aliases.append(torch.ops.aten.alias.default(x))
                return aliases[-1]
            return x

        out = func(*tree_map(alias, args), **tree_map(alias, kwargs))
        works = [w for w in tree_leaves(out) if isinstance(w, torch.ScriptObject)]
        if works and aliases:
            # unbox gives the Python Work object the caller receives too (one per C++ Work)
            self._lent.append((Work.unbox(works[0]), aliases))
        return out

    def _take_back_lent(self, timeout_s: float = 1.0) -> None:
        """Drop the aliases of every completed op whose Work the program no longer holds, once the
        backend has let go of them (each alias then has one reference: ours)."""
        pending, self._lent = self._lent, []
        while pending:
            work, aliases = pending.pop(0)
            # references to the Work: `work` and getrefcount's argument; more: the program's
            if not work.is_completed() or sys.getrefcount(work) > 2:
                self._lent.append((work, aliases))
                continue
            del work
            deadline = time.monotonic() + timeout_s
            while any(a._use_count() > 1 for a in aliases) and time.monotonic() < deadline:
                time.sleep(0)                   # lets the backend's worker thread finish
            del aliases                         # frees what the program let go of, here

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self._take_back_lent()
        self._lent.clear()
        return out


def _on_gloo(args) -> bool:
    """A c10d op's process group (its first ScriptObject argument) is gloo's (the fake group of
    the planner's dry run never completes its Works and keeps no tensors)."""
    import torch.distributed as dist

    group = next((a for a in args if isinstance(a, torch.ScriptObject)), None)
    return group is not None and dist.ProcessGroup.unbox(group)._get_backend_name() == "gloo"


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
