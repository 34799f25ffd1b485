"""Gradient sums over a group for weights every rank of it holds whole (replicated) but applies to
different tokens or partial activations.

`ReplicatedGrads` (TSP's norms and its replicated o_proj / down_proj biases): each forward pass
hands the layers views of all of them, whose backward adds their partial gradients into one flat
fp32 buffer; one autograd node that runs after them all sums the buffer over the group in one
all-reduce (as Megatron's finalize_model_grads does after backward) and hands each parameter its
slice. So each .grad holds the full gradient when autograd accumulates it, for DeepSpeed's
reduction hooks and clipping alike. TSP's copies of K/V heads fewer than D are a second instance,
on the group of ranks sharing a head (tag "kv.grad", parallel/apply.py `kv_copies`).

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
KV_GRAD_TAG = "kv.grad"      # K/V head copies (K/V heads fewer than D): summed over their sharers


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


class _Buffer:
    """One pass's replicated gradients in one flat fp32 buffer, a slot per parameter (as Megatron's
    grad buffer), made when the backward writes its first gradient (the forward holds none)."""

    def __init__(self, params: list[nn.Parameter], device: torch.device):
        self.numels = [p.numel() for p in params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]
        self.device, self.flat = device, None

    def add(self, index: int, grad: torch.Tensor) -> None:
        start = self.offsets[index]
        self.full()[start:start + self.numels[index]].add_(grad.reshape(-1))

    def full(self) -> torch.Tensor:
        if self.flat is None:
            self.flat = torch.zeros(sum(self.numels), device=self.device)
        return self.flat


class _SumOnce(torch.autograd.Function):
    """Forward: the anchor every view of the pass hangs from (a scalar). Backward, after every
    view's backward: one all-reduce (sum) of the pass's buffer, each parameter's slot returned in
    its dtype."""

    @staticmethod
    def forward(ctx, comm: Comm, tag: str, buffer: _Buffer, done, *params):
        ctx.comm, ctx.tag, ctx.buffer, ctx.done = comm, tag, buffer, done
        ctx.shapes, ctx.dtypes = [p.shape for p in params], [p.dtype for p in params]
        return torch.zeros((), device=buffer.device)

    @staticmethod
    def backward(ctx, _):
        flat = ctx.buffer.full()
        ctx.comm.all_reduce(flat, tag=ctx.tag)
        ctx.done()
        summed = flat.split(ctx.buffer.numels)
        return (None, None, None, None, *(g.view(shape).to(dtype)
                                    for g, shape, dtype in zip(summed, ctx.shapes, ctx.dtypes)))


class _View(torch.autograd.Function):
    """Forward: a view of one parameter, tied to the pass's anchor. Backward: its gradient added
    into its slot of the buffer (fp32) as soon as it is computed; the parameter's gradient comes
    from _SumOnce."""

    @staticmethod
    def forward(ctx, anchor, boxed: tuple[nn.Parameter], buffer: _Buffer, index: int):
        ctx.buffer, ctx.index = buffer, index
        (weight,) = boxed
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        ctx.buffer.add(ctx.index, grad)
        return torch.zeros((), device=grad.device), None, None, None


class ReplicatedGrads:
    """The replicated parameters of one model on one group, and this pass's views of them.
    `begin_pass` (a forward pre-hook on the model's first module) opens the pass: its buffer and
    the anchor of its one all-reduce; `use` is how a layer reads its replicated weight in it.
    `tag`: the all-reduce's ledger tag (KV_GRAD_TAG for the K/V head copies, summed over the ranks
    that share a K/V head)."""

    def __init__(self, comm: Comm, tag: str = REPLICATED_GRAD_TAG):
        self.comm, self.tag = comm, tag
        self.params: list[nn.Parameter] = []
        self._index: dict[int, int] = {}
        self._buffer: _Buffer | None = None
        self._anchor: torch.Tensor | None = None
        self._views: dict[int, torch.Tensor] = {}

    def add(self, param: nn.Parameter) -> None:
        self._index[id(param)] = len(self.params)
        self.params.append(param)

    def begin_pass(self, *_) -> None:
        """A new forward pass: its gradients are summed at the end of its backward when there is
        something to sum (grad enabled, more than one rank); otherwise layers read the parameters."""
        self._buffer, self._anchor, self._views = None, None, {}
        if not (torch.is_grad_enabled() and self.comm.size > 1 and any(p.requires_grad for p in self.params)):
            return
        buffer = _Buffer(self.params, self.comm.device)

        def done() -> None:               # the pass's backward is over: layers read the parameters
            if self._buffer is buffer:
                self._buffer, self._anchor, self._views = None, None, {}
        self._anchor = _SumOnce.apply(self.comm, self.tag, buffer, done, *self.params)
        self._buffer = buffer

    def use(self, param: nn.Parameter) -> torch.Tensor:
        """This pass's view of `param` (the parameter itself outside a pass that sums gradients).
        Made at its first use, so autograd runs its backward as soon as the gradient is in (nodes
        run latest-made first), and reused by a checkpoint's replay."""
        if self._buffer is None or id(param) not in self._index:
            return param
        if id(param) not in self._views:
            # boxed: no autograd edge to the parameter (its gradient comes from _SumOnce), and the
            # view's base is still the Parameter (activation offload leaves those in place)
            self._views[id(param)] = _View.apply(self._anchor, (param,), self._buffer, self._index[id(param)])
        return self._views[id(param)]
