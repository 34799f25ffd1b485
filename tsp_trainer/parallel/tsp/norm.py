"""Replicated RMSNorm under TSP: the weight is the same on every rank of the tsp group, but each
rank sees different tokens, so each rank's gradient is partial. The layer reads its weight through
the pass's `ReplicatedGrads` view, whose backward sums all replicated gradients over the group in
one fp32 all-reduce (parallel/grad_sync.py)."""

from __future__ import annotations

import torch

from tsp_trainer.model.layers import RMSNorm
from tsp_trainer.parallel.grad_sync import ReplicatedGrads


class TSPRMSNorm(RMSNorm):
    def __init__(self, norm: RMSNorm, *, replicated: ReplicatedGrads):
        super().__init__(norm.weight.shape[0], norm.eps, device="meta")   # weight replaced below
        self.weight = norm.weight
        self.replicated = replicated
        replicated.add(self.weight)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(x, self.replicated.use(self.weight))
