"""Non-finite detection for one optimizer step, agreed by every rank before the update.

Everything lives on the run's compute device and costs no host sync until the single agreement
at the gradient-accumulation boundary: a per-parameter gradient hook ORs `~isfinite(grad).all()`
into a device flag (a host `bool(...)` there would stall the CPU once per parameter and
micro-step), a non-finite loss is noted the same way, and `agree()` all-reduces the flag (MAX)
over the world group and reads it once. Under NCCL the flag must be a CUDA tensor: the process
group serves nothing else (Comm's device guard says so by name if it is not).
"""

from __future__ import annotations

from typing import Iterable

import torch

from tsp_trainer.parallel.comm import Comm


class NonFiniteFlags:
    """This rank's "saw a non-finite loss or gradient this step" flag and its agreement."""

    def __init__(self, world: Comm):
        self.world = world
        self.flag = torch.zeros((), dtype=torch.bool, device=world.device)

    def watch(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Flag non-finite raw gradients as autograd produces them (before any reduction)."""
        def hook(grad: torch.Tensor) -> torch.Tensor:
            self.flag.logical_or_(~torch.isfinite(grad).all())
            return grad
        for p in params:
            p.register_hook(hook)

    def poison_if_nonfinite(self, loss_sum: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        """Note a non-finite `loss_sum` and return `loss` scaled by 1 (finite) or NaN (not), so a
        non-finite loss turns every gradient it touches into NaN (an additive NaN would leave them
        finite) and the overflow check downstream skips the update. No host sync."""
        finite = torch.isfinite(loss_sum.detach())
        self.flag.logical_or_(~finite)
        scale = torch.where(finite, 1.0, float("nan")).to(loss.dtype)   # exact 1.0 when finite
        return loss * scale

    def reset(self) -> None:
        self.flag.zero_()

    def agree(self) -> bool:
        """All-reduce (MAX) the flag over every rank: one host read per optimizer step."""
        shared = self.flag.to(torch.float32)
        self.world.all_reduce(shared, tag="nonfinite.flag", op=torch.distributed.ReduceOp.MAX)
        return bool(shared)
