"""Replicated RMSNorm under TSP: the weight is the same on every rank of the tsp group, but each
rank sees different tokens, so each rank's gradient is partial. The sum over the group happens
inside autograd (identity forward, all-reduce backward on the weight, in fp32), so whoever reads
.grad after backward (DeepSpeed's reduction hooks included) sees the full gradient."""

from __future__ import annotations

import torch

from tsp_trainer.model.layers import RMSNorm
from tsp_trainer.parallel.comm import Comm
from tsp_trainer.parallel.grad_sync import SumGradOverGroup


class TSPRMSNorm(RMSNorm):
    def __init__(self, norm: RMSNorm, *, comm: Comm):
        super().__init__(norm.weight.shape[0], norm.eps, device="meta")   # weight replaced below
        self.weight = norm.weight
        self.comm = comm

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(x, SumGradOverGroup.apply(self.weight, self.comm, "norm.grad", True))
