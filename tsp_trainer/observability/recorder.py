"""StepRecorder: builds each optimizer step's metrics dict under the names of metric_names.py
(throughput, MFU, memory, per-op communication bytes, data wait, the slowest rank).

The Trainer calls begin_step() / waiting_for_data() / end_step(); nothing here imports torch.distributed
or the parallel package. The one collective, the rank-stats gather every `rank_stats_every` steps,
goes through the world `Comm` the Trainer hands in (duck-typed: `all_gather(out, inp, tag=...)`).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from tsp_trainer.observability.metric_names import comm_metric_name
from tsp_trainer.observability.metrics import StepMetrics, peak_memory_bytes, reset_peak_memory


class StepRecorder:
    """Per-step timing and the metrics dict of one step.

    Args:
        world: a Comm over every rank (the rank-stats gather); its ledger is the mesh's.
        flops: (model, hardware) FLOPs per training token (observability/flops.py).
        peak_flops: peak FLOP/s of one device, None when unknown (no MFU then).
        rank_stats_every: gather every rank's own step time and data wait every N steps (0 = never).
        device: the compute device (collective buffers live there; the CUDA peak is reset there).
    """

    def __init__(self, *, world, flops: tuple[float, float], peak_flops: float | None,
                 rank_stats_every: int, device: torch.device):
        self.world, self.ledger = world, world.ledger
        self.flops, self.peak_flops = flops, peak_flops
        self.rank_stats_every, self.device = rank_stats_every, device
        self._t0, self._data_wait = 0.0, 0.0

    def begin_step(self) -> None:
        reset_peak_memory(self.device)       # mem/peak_gib is this step's peak (no-op on CPU)
        self.ledger.reset()
        self._t0, self._data_wait = time.perf_counter(), 0.0

    @contextlib.contextmanager
    def waiting_for_data(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            self._data_wait += time.perf_counter() - start

    def end_step(self, step: int, *, loss: float, lr: float, grad_norm: float | None, tokens: int,
                 skipped: bool, skipped_steps: int, tokens_seen: int,
                 checkpoint_stall_s: float = 0.0,
                 flops: tuple[float, float] | None = None) -> dict[str, Any]:
        """The step's metrics. Collective every rank_stats_every steps (all ranks call it).
        `flops` overrides the (model, hardware) FLOPs per token for this step (a sequence-length
        schedule changes them from stage to stage)."""
        flops = self.flops if flops is None else flops
        dt = time.perf_counter() - self._t0
        own = dt - self.ledger.blocked_s           # read before the gather adds its own wait
        comm = {comm_metric_name(axis, op): nbytes
                for (axis, op), nbytes in sorted(self.ledger.bytes_by("axis", "op").items())}
        m = StepMetrics.compute(tokens=tokens, step_time_s=dt, world_size=self.world.size,
                                model_flops_per_token=flops[0],
                                hardware_flops_per_token=flops[1],
                                peak_flops_per_device=self.peak_flops)
        out = {"train/loss": loss, "train/lr": lr, "train/grad_norm": grad_norm,
               "train/skipped": int(skipped), "train/skipped_steps": skipped_steps,
               "train/tokens_seen": tokens_seen, "perf/tokens_per_s": m.tokens_per_s,
               "perf/tokens_per_s_per_gpu": m.tokens_per_s_per_device,
               "perf/tflops_per_gpu": m.tflops_per_device, "perf/mfu": m.mfu, "perf/hfu": m.hfu,
               "perf/step_time_s": dt, "perf/data_wait_s": self._data_wait,
               "perf/checkpoint_stall_s": checkpoint_stall_s,
               "mem/peak_gib": peak_memory_bytes(self.device) / 2**30, **comm}
        if self.rank_stats_every and step % self.rank_stats_every == 0:
            out.update(self._rank_stats(own))
        return out

    def _rank_stats(self, own_s: float) -> dict[str, Any]:
        """Every rank's (own step time, data wait) -> the slowest rank and the longest wait."""
        mine = torch.tensor([own_s, self._data_wait], dtype=torch.float64, device=self.device)
        every = torch.empty(2 * self.world.size, dtype=torch.float64, device=self.device)
        self.world.all_gather(every, mine, tag="rank_stats")
        every = every.view(self.world.size, 2).cpu()          # [world, (own_s, data_wait_s)]
        slowest = int(every[:, 0].argmax())
        return {"perf/step_time_max_rank": float(every[slowest, 0]), "perf/slowest_rank": slowest,
                "perf/data_wait_max_rank": float(every[:, 1].max())}
