"""The one autograd function shared by TSP and the baselines: identity forward, sum of the gradient
over a group in backward. TSP and SP use it on replicated weights whose ranks see different tokens
(norms; every weight under SP); Megatron TP uses it to enter a TP region (copy_to_region)."""

from __future__ import annotations

import torch

from tsp_trainer.parallel.comm import Comm


class SumGradOverGroup(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (sum) of the gradient over `comm`."""

    @staticmethod
    def forward(ctx, x, comm: Comm, tag: str):
        ctx.comm, ctx.tag = comm, tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        ctx.comm.all_reduce(grad, tag=ctx.tag)
        return grad, None, None
