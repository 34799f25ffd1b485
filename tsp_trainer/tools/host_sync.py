"""Count the operations of a region that make the host wait for the device on CUDA.

The CPU can run ahead of a GPU only while it never needs a result: each of these stalls it until
every kernel queued before has finished. They are counted by kind and by the line of Python that
issued them, on any device (a CPU test counts what the same code would stall on a GPU):

  item            a tensor read as a Python number: .item(), bool(), int(), float() (the
                  dispatcher's aten._local_scalar_dense)
  tolist          Tensor.tolist()
  data_dependent  ops whose output shape depends on values: nonzero, masked_select, unique,
                  boolean-mask indexing (x[mask], x[mask] = y), repeat_interleave without
                  output_size
  host_to_device  Python data or a host tensor copied to the compute device without
                  non_blocking: torch.tensor(data, device=...), .to(device) / .cuda() of a CPU
                  tensor

On CPU, a .to(device) names no real copy (host and compute device are one); it is counted when the
target is the compute device and the source a CPU tensor, as it would be on a GPU, so the figure
errs on the high side. torch.cuda.set_sync_debug_mode sees only what really syncs, on a real GPU.
"""

from __future__ import annotations

import collections
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_FILE = os.path.abspath(__file__)


def _aten_data_dependent():
    aten = torch.ops.aten
    return {aten.nonzero.default, aten.masked_select.default, aten._unique2.default,
            aten.unique_dim.default, aten.unique_consecutive.default}


class HostSyncCounter:
    """with HostSyncCounter(device) as c: ...  then c.total, c.by_kind, c.by_site."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.by_kind: collections.Counter = collections.Counter()
        self.by_site: collections.Counter = collections.Counter()   # "file:line kind" -> count
        self._dispatch_mode = _DispatchSide(self)
        self._patches = _PythonSide(self)

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def record(self, kind: str) -> None:
        self.by_kind[kind] += 1
        self.by_site[f"{_caller_site()} {kind}"] += 1

    def count_from(self, prefix: str) -> int:
        """Syncs issued from files under `prefix` (e.g. the package directory)."""
        return sum(n for site, n in self.by_site.items() if site.startswith(prefix))

    def __enter__(self) -> "HostSyncCounter":
        self._patches.install()
        self._dispatch_mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._dispatch_mode.__exit__(*exc)
        self._patches.remove()


class _PythonSide:
    """tolist and host->device copies: Python-level calls that reach no dispatcher op on CPU.
    Wrapped for the counter's lifetime (a TorchFunctionMode would miss them in backward: the
    autograd engine does not carry torch-function modes into backward passes)."""

    def __init__(self, counter: HostSyncCounter):
        self.counter, self._saved = counter, {}

    def install(self) -> None:
        counter, originals = self.counter, {}
        originals["tolist"] = torch.Tensor.tolist
        originals["to"] = torch.Tensor.to
        originals["cuda"] = torch.Tensor.cuda
        originals["tensor"] = torch.tensor

        def tolist(t, *a, **k):
            counter.record("tolist")
            return originals["tolist"](t, *a, **k)

        def to(t, *a, **k):
            if _copies_to(counter.device, t, a, k):
                counter.record("host_to_device")
            return originals["to"](t, *a, **k)

        def cuda(t, *a, **k):
            if t.device.type == "cpu" and not k.get("non_blocking"):
                counter.record("host_to_device")
            return originals["cuda"](t, *a, **k)

        def tensor(data, *a, **k):
            # torch.tensor(data, device=<compute device>) copies host data; without a device the
            # tensor is made on the host (no copy, nothing to wait for)
            target = k.get("device")
            if target is not None and torch.device(target).type == counter.device.type:
                counter.record("host_to_device")
            return originals["tensor"](data, *a, **k)

        self._saved = originals
        torch.Tensor.tolist, torch.Tensor.to, torch.Tensor.cuda, torch.tensor = tolist, to, cuda, tensor

    def remove(self) -> None:
        if self._saved:
            torch.Tensor.tolist, torch.Tensor.to = self._saved["tolist"], self._saved["to"]
            torch.Tensor.cuda, torch.tensor = self._saved["cuda"], self._saved["tensor"]
            self._saved = {}


def _copies_to(device: torch.device, t: torch.Tensor, args, kwargs) -> bool:
    """t.to(...) copies a host tensor to the compute device without non_blocking (the first
    positional bool of Tensor.to is non_blocking)."""
    if t.device.type != "cpu":
        return False
    flags = [a for a in args if isinstance(a, bool)]
    if kwargs.get("non_blocking") or (flags and flags[0]):
        return False
    target = kwargs.get("device", next((a for a in args if isinstance(a, (torch.device, str))), None))
    return target is not None and torch.device(target).type == device.type


class _DispatchSide(TorchDispatchMode):
    """item/bool/int/float and data-dependent shapes: visible at the dispatcher."""

    def __init__(self, counter: HostSyncCounter):
        super().__init__()
        self.counter = counter
        self._data_dependent = _aten_data_dependent()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        if func is aten._local_scalar_dense.default:
            self.counter.record("item")
        elif func in self._data_dependent:
            self.counter.record("data_dependent")
        elif func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                      aten._index_put_impl_.default):
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None):
                self.counter.record("data_dependent")
        elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self.counter.record("data_dependent")
        return func(*args, **kwargs)


def _caller_site() -> str:
    """file:line of the innermost frame outside torch and this module."""
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_TORCH_DIR) and path != _THIS_FILE:
            return f"{path}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"

