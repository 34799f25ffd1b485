"""The one autograd function shared by TSP and the baselines: identity forward, sum of the gradient
over a group in backward. TSP and SP use it on replicated weights whose ranks see different tokens
(norms; every weight under SP); Megatron TP uses it to enter a TP region (copy_to_region).

Weight gradients are summed in fp32 (`fp32=True`): each rank's partial is exact in its dtype, but
their sum over the group rounded to bf16 would lose what fp32 accumulation keeps everywhere else.
Activation gradients entering a TP region are reduced in their own dtype, as Megatron does."""

from __future__ import annotations

import torch

from tsp_trainer.parallel.comm import Comm

# Weight-gradient reductions and TSP's gradient ring accumulators are fp32 in every run dtype
# (4 bytes per element on the wire; the comm models count them so).
GRAD_BYTES = 4


class SumGradOverGroup(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (sum) of the gradient over `comm`, in fp32 when
    `fp32` (weight gradients), else in the gradient's dtype."""

    @staticmethod
    def forward(ctx, x, comm: Comm, tag: str, fp32: bool = False):
        ctx.comm, ctx.tag, ctx.fp32 = comm, tag, fp32
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        summed = grad.to(torch.float32 if ctx.fp32 else grad.dtype, copy=True)
        ctx.comm.all_reduce(summed, tag=ctx.tag)
        return summed.to(grad.dtype), None, None, None
