"""The bytes DeepSpeed's ZeRO-3 hands to torch.distributed, counted where it hands them: its comm
backend (deepspeed/comm/torch.py TorchBackend, 0.19.8) binds torch.distributed's
all_gather_into_tensor and reduce_scatter_tensor when it is created and issues every parameter
gather and gradient reduce-scatter through them. `ZeroCollectiveBytes.install()` wraps both in this
process before that binding; the wrappers count the full tensor of each call (the all-gather's
output, the reduce-scatter's input: the ledger's payload conventions, parallel/ledger.py) while
`counting()` is open, so the ops of other schemes in the same process stay out.
parallel/sharded_weights.py `Zero3Traffic` is the closed form of the same bytes; tsp-bench reports
both, and tests/distributed/test_bench.py and test_sharded_weights.py check they are equal.
"""

from __future__ import annotations

import collections
import contextlib
import inspect

import torch.distributed

# torch.distributed op -> (the ledger's op name, the argument whose bytes are the payload)
COUNTED = {"all_gather_into_tensor": ("all_gather", "output_tensor"),
           "reduce_scatter_tensor": ("reduce_scatter", "input")}


class ZeroCollectiveBytes:
    """Bytes per op ("all_gather", "reduce_scatter") of the calls made while `counting()` is open."""

    def __init__(self):
        self.bytes: collections.Counter = collections.Counter()
        self._active = 0

    def install(self) -> ZeroCollectiveBytes:
        """Wrap the two ops in this process. Before DeepSpeed's comm backend exists: it keeps the
        functions it found when it was created."""
        import deepspeed.comm as ds_comm

        if ds_comm.is_initialized():
            raise RuntimeError("ZeroCollectiveBytes.install() after deepspeed.comm was initialised: "
                               "its backend already holds the unwrapped ops; install it first")
        for name, (op, arg) in COUNTED.items():
            real = getattr(torch.distributed, name)
            setattr(torch.distributed, name, self._wrap(real, op, arg))
        return self

    def _wrap(self, real, op: str, arg: str):
        signature = inspect.signature(real)

        def counting_call(*args, **kwargs):
            if self._active:
                tensor = signature.bind(*args, **kwargs).arguments[arg]
                self.bytes[op] += tensor.numel() * tensor.element_size()
            return real(*args, **kwargs)
        return counting_call

    @contextlib.contextmanager
    def counting(self):
        self._active += 1
        try:
            yield self
        finally:
            self._active -= 1

    def reset(self) -> None:
        self.bytes.clear()


_PROCESS_COUNTER: ZeroCollectiveBytes | None = None


def process_counter() -> ZeroCollectiveBytes:
    """This process's one installed counter (installed on the first call)."""
    global _PROCESS_COUNTER
    if _PROCESS_COUNTER is None:
        _PROCESS_COUNTER = ZeroCollectiveBytes().install()
    return _PROCESS_COUNTER
