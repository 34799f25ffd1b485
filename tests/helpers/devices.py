"""Stand-ins on CPU for device placement that only a GPU would otherwise check.

On a GPU the host default device (CPU) is not the compute device (CUDA): a tensor created without
`device=` inside code that runs on the compute device lands on the host, and fails when it meets
a CUDA tensor or an NCCL collective. On a CPU-only machine both are the CPU and nothing fails.
`HostDefaultElsewhere` makes them differ again: while it is active, tensor factories called from
the given packages without a device create their tensor on the meta device instead of the host.
Such a tensor then fails exactly where a stray host tensor fails under CUDA: mixed with compute
tensors ("Expected all tensors to be on the same device") or handed to a collective (the Comm
device guard names the op; a process group serving only CPU tensors rejects it too)."""

from __future__ import annotations

import contextlib
import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

# Every package whose tensors meet the compute device or a collective. Left out: tsp_trainer.data
# (builds the host batches the Trainer copies over) and tsp_trainer.checkpoint (reads and writes
# files through host tensors that safetensors and torch.load create on the host by design).
COMPUTE_PACKAGES = ("tsp_trainer.trainer", "tsp_trainer.parallel", "tsp_trainer.model", "tsp_trainer.eval",
                    "tsp_trainer.run", "tsp_trainer.observability", "tsp_trainer.engine")


class HostDefaultElsewhere(TorchFunctionMode):
    def __init__(self, packages=COMPUTE_PACKAGES, device: str = "meta"):
        super().__init__()
        self.packages, self.device = tuple(packages), torch.device(device)
        self.redirected: list[str] = []          # "module:line function" of every redirected call

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _device_constructors() and kwargs.get("device") is None:
            caller = sys._getframe(1)
            module = caller.f_globals.get("__name__", "")
            if module.startswith(self.packages):
                kwargs["device"] = self.device
                self.redirected.append(f"{module}:{caller.f_lineno} {func.__name__}")
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def named_on_failure(self):
        """An error inside the block also names the calls redirected so far: the likely cause."""
        try:
            yield
        except Exception as err:
            raise RuntimeError(f"{err} (calls redirected to {self.device}: {self.redirected})") from err
