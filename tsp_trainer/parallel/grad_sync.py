"""Gradient sums over a group for weights every rank of it holds whole (replicated) but applies to
different tokens or partial activations.

`ReplicatedGrads` (TSP's norms and its replicated o_proj / down_proj biases): one autograd node per
forward pass hands out views of all of them; its backward runs once every view's gradient is in,
after the rest of the backward, and sums them over the group in one flattened fp32 all-reduce
(as Megatron's finalize_model_grads does after backward). So each parameter's .grad holds the full
gradient when autograd accumulates it, for DeepSpeed's reduction hooks and clipping alike.

`SumGradOverGroup` (the baselines): identity forward, all-reduce of one gradient in backward;
Megatron TP enters a TP region with it (an activation gradient, needed before backward goes on).

Weight gradients are summed in fp32: each rank's partial is exact in its dtype, but their sum
rounded to bf16 would lose what fp32 accumulation keeps everywhere else."""

from __future__ import annotations

import torch
import torch.nn as nn

from tsp_trainer.parallel.comm import Comm

# Weight-gradient reductions and TSP's gradient ring accumulators are fp32 in every run dtype
# (4 bytes per element on the wire; the comm models count them so).
GRAD_BYTES = 4

REPLICATED_GRAD_TAG = "replicated.grad"


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


class _SumGradsOnce(torch.autograd.Function):
    """Forward: a view of each parameter. Backward: their gradients packed into one fp32 buffer,
    all-reduced (sum) over `comm` in one op, unpacked in each parameter's dtype."""

    @staticmethod
    def forward(ctx, comm: Comm, done, *params):
        ctx.comm, ctx.done = comm, done
        ctx.shapes, ctx.dtypes = [p.shape for p in params], [p.dtype for p in params]
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, *grads):
        # every rank runs the same graph: a view unused in this pass (no gradient) is zero everywhere
        flat = torch.cat([torch.zeros(shape.numel(), device=ctx.comm.device) if g is None
                          else g.reshape(-1).to(torch.float32) for g, shape in zip(grads, ctx.shapes)])
        ctx.comm.all_reduce(flat, tag=REPLICATED_GRAD_TAG)
        summed = flat.split([shape.numel() for shape in ctx.shapes])
        ctx.done()
        return (None, None, *(s.view(shape).to(dtype) for s, shape, dtype in zip(summed, ctx.shapes, ctx.dtypes)))


class ReplicatedGrads:
    """The replicated parameters of one model on one group, and this pass's views of them.
    `begin_pass` (a forward pre-hook on the model's first module) makes the views, `use` is how a
    layer reads its replicated weight in the pass; the views are dropped once their gradients are
    summed."""

    def __init__(self, comm: Comm):
        self.comm = comm
        self.params: list[nn.Parameter] = []
        self._views: dict[int, torch.Tensor] = {}

    def add(self, param: nn.Parameter) -> None:
        self.params.append(param)

    def begin_pass(self, *_) -> None:
        """A new forward pass: views through one _SumGradsOnce node when its backward will sum
        partial gradients (grad enabled, more than one rank), else the parameters themselves."""
        self._views = views = {}
        if torch.is_grad_enabled() and self.comm.size > 1 and any(p.requires_grad for p in self.params):

            def done() -> None:
                if self._views is views:       # not a later pass's views
                    self._views = {}
            out = _SumGradsOnce.apply(self.comm, done, *self.params)
            views.update({id(p): v for p, v in zip(self.params, out)})

    def use(self, param: nn.Parameter) -> torch.Tensor:
        """This pass's view of `param` (the parameter itself outside a pass that sums gradients)."""
        return self._views.get(id(param), param)
