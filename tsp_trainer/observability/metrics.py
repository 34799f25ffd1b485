"""Per-step throughput and utilisation (tokens/s, tokens/s/device, TFLOP/s/device, MFU, HFU), device
peak FLOP/s, and peak memory. No collectives: the caller passes global token counts and world size.

StepRecorder (recorder.py) logs these under the names of metric_names.py: perf/tokens_per_s,
perf/tokens_per_s_per_gpu, perf/tflops_per_gpu, perf/mfu, perf/hfu, perf/step_time_s, and
`peak_memory_bytes()` as mem/peak_gib.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import asdict, dataclass

import torch

# Dense (no sparsity) bf16 peak FLOP/s per device, from the vendors' data sheets. CPU has no
# meaningful peak: MFU is reported as None there unless the caller passes one.
DEVICE_PEAK_FLOPS: dict[str, float | None] = {
    "h100": 989e12,        # H100 SXM5
    "h100 pcie": 756e12,   # H100 PCIe (the name torch reports contains "H100 PCIe")
    "h200": 989e12,        # same compute die as H100 SXM, more HBM
    "mi300x": 1307e12,
    "cpu": None,
}


def peak_flops_for(device_name: str) -> float | None:
    """Peak bf16 FLOP/s for a device name such as torch.cuda.get_device_name() returns
    ("NVIDIA H100 80GB HBM3", "AMD Instinct MI300X"); None for CPU or an unknown device.
    The longest matching key wins, so "H100 PCIe" is not taken for an H100 SXM."""
    name = device_name.lower()
    matches = [key for key in DEVICE_PEAK_FLOPS if key in name]
    return DEVICE_PEAK_FLOPS[max(matches, key=len)] if matches else None


def detect_peak_flops(device: torch.device | str | None = None) -> float | None:
    """Peak FLOP/s of the current (or given) accelerator, None on CPU or when unknown."""
    device = torch.device(device) if device is not None else None
    if (device is not None and device.type != "cuda") or not torch.cuda.is_available():
        return None
    return peak_flops_for(torch.cuda.get_device_name(device))


@dataclass(frozen=True)
class StepMetrics:
    """Throughput of one optimizer step over the whole job.

    tokens is the global count (micro x grad_accum x dp_degree x seq_len). Per-device numbers divide by
    world_size (= dp x tsp), because every rank of a TSP group works on the same tokens: this is the
    paper's tokens/s/GPU. TFLOP/s and MFU use model FLOPs; HFU uses hardware FLOPs (with recompute).
    """

    tokens: int
    step_time_s: float
    tokens_per_s: float
    tokens_per_s_per_device: float
    tflops_per_device: float
    mfu: float | None
    hfu: float | None

    @classmethod
    def compute(cls, *, tokens: int, step_time_s: float, world_size: int, model_flops_per_token: float,
                hardware_flops_per_token: float | None = None,
                peak_flops_per_device: float | None = None) -> "StepMetrics":
        """MFU = model_flops_per_token * tokens/s/device / peak; None when no peak is known (CPU)."""
        if step_time_s <= 0:
            raise ValueError(f"step_time_s={step_time_s} must be > 0")
        if world_size <= 0:
            raise ValueError(f"world_size={world_size} must be > 0")
        tps = tokens / step_time_s
        tps_dev = tps / world_size
        flops_dev = model_flops_per_token * tps_dev
        mfu = hfu = None
        if peak_flops_per_device:
            mfu = flops_dev / peak_flops_per_device
            if hardware_flops_per_token is not None:
                hfu = hardware_flops_per_token * tps_dev / peak_flops_per_device
        return cls(tokens=tokens, step_time_s=step_time_s, tokens_per_s=tps, tokens_per_s_per_device=tps_dev,
                   tflops_per_device=flops_dev / 1e12, mfu=mfu, hfu=hfu)

    def as_dict(self) -> dict[str, float | int | None]:
        return asdict(self)


def peak_memory_bytes(device: torch.device | str | None = None) -> int:
    """Peak memory of this process.

    On a CUDA/ROCm device: torch.cuda.max_memory_allocated (allocator bytes held by tensors, since
    the last reset_peak_memory()). On CPU: the process's maximum resident set size from
    resource.getrusage, i.e. RSS of the whole process (Python, libraries, allocator caches), not the
    tensor allocator's bytes, and it cannot be reset. For per-tensor CPU accounting use the memory
    tools of tsp_trainer/tools/memory.py (MemTracker, saved-tensor hooks).
    """
    device = torch.device(device) if device is not None else None
    if torch.cuda.is_available() and (device is None or device.type == "cuda"):
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)   # Linux reports KiB, macOS bytes


def reset_peak_memory(device: torch.device | str | None = None) -> None:
    """Start a new peak window on the accelerator; a no-op on CPU (max RSS cannot be reset)."""
    device = torch.device(device) if device is not None else None
    if torch.cuda.is_available() and (device is None or device.type == "cuda"):
        torch.cuda.reset_peak_memory_stats(device)
