"""Replicated RMSNorm under TSP: the weight is the same on every rank of the tsp group, but each
rank sees different tokens, so each rank's gradient is partial. The layer reads its weight through
the pass's `ReplicatedGrads` view, whose backward sums all replicated gradients over the group in
one fp32 all-reduce (parallel/grad_sync.py).

A block's two norms can hand their work to the layer that consumes their output (`NormHandoff`):
once the layer's tokens are tiled (parallel/gated_mlp.py `TokenTiling`: the MLP's token chunks,
`parallel.mlp_chunk_tokens`, which `auto` tiles only when memory asks for it) in a pass that records
a backward, the norm passes its input through unchanged and the TSP attention or MLP normalises it
itself, keeping the norm's input (the block input, or the residual x + attn: tensors the block
keeps anyway) and rstd [n, 1] instead of an [n, h] output, and remaking the output where it reads
it, one token chunk at a time (`NormedRows`): per owner projection and dW_qkv, per MLP ring step.
A checkpointed block's first forward, whose saved tensors are dropped, makes the output at once
(one pass, as the norm would). The forward is RmsNormFn's to the bit (model/rms_norm.py); the
consumer's backward applies the norm's backward to its dX in place and returns the weight's part.

Cost, per layer and step: D norm applications per consumer in a forward that keeps its tensors
(instead of one), and in backward D for the MLP and D for the attention's dW_qkv, D more for its
projections under full recompute: about 5D more elementwise passes over [n, h] under checkpointing
than the norms' own (plan/flops.py norm_handoff_bytes_per_token). Beside the layer's GEMMs and
attention over the same tokens that is under 1% of the planner's step from the tiling threshold
(~50K local tokens for Llama-3-8B at D 8) on, falling as 1/S. An untiled layer (every default far
past 128K tokens on 8 ranks) and every pass without a backward run the norm as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tsp_trainer.model.layers import RMSNorm
from tsp_trainer.model.rms_norm import rms_norm_apply, rms_norm_backward_in_place, rms_norm_rstd
from tsp_trainer.parallel.gated_mlp import add_matmul
from tsp_trainer.parallel.grad_sync import ReplicatedGrads


class TSPRMSNorm(RMSNorm):
    """`tiling`: the consuming layer's token tiling; given, the norm hands its work over to that
    layer (`handoff`) whenever the tiling cuts its input into more than one chunk."""

    def __init__(self, norm: RMSNorm, *, replicated: ReplicatedGrads, tiling=None):
        super().__init__(norm.weight.shape[0], norm.eps, device="meta")   # weight replaced below
        self.weight = norm.weight
        self.replicated = replicated
        replicated.add(self.weight)
        self.handoff = None if tiling is None else NormHandoff(self, tiling)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        if self.handoff is not None and self.handoff.defer(x):
            return x                      # the consumer normalises (NormHandoff)
        return super().forward(x, self.replicated.use(self.weight))


class NormHandoff:
    """Between a TSPRMSNorm and the layer that consumes its output, in the block's order: the
    norm's forward calls `defer(x)`, the consumer's forward `take()` right after. Not a module:
    the weight stays registered under the norm's name (state dicts, ReplicatedGrads)."""

    def __init__(self, norm: TSPRMSNorm, tiling):
        self.norm, self.tiling = norm, tiling
        self._deferred: bool | None = None

    def defer(self, x: torch.Tensor) -> bool:
        """Whether the consumer normalises x [..., h]: when the layer tiles its tokens and the pass
        records a backward (without one nothing is saved: the norm runs itself, once)."""
        self._deferred = torch.is_grad_enabled() and len(self.tiling.chunks(x)) > 1
        return self._deferred

    def take(self) -> tuple[torch.Tensor, float] | None:
        """(the norm weight's view for this pass, eps) when the norm's forward just handed its work
        over (the consumer's input is the norm's input), else None: its input is the norm's output
        (or, called without the norm, whatever the caller gives it)."""
        deferred, self._deferred = self._deferred, None
        if not deferred:
            return None
        return self.norm.replicated.use(self.norm.weight), self.norm.eps


class NormedRows:
    """The norm's output of x2 [n, h], made a chunk of rows at a time: `rows[c]` for a slice c is
    rms_norm(x2[c]) [c, h] (the norm's own forward to the bit: model/rms_norm.py rms_norm_apply),
    rstd [n, 1] computed once for the backward.
    Stands in for the normed tensor where a layer reads it by token chunks."""

    def __init__(self, x2: torch.Tensor, weight: torch.Tensor, eps: float, rstd: torch.Tensor,
                 chunks: list[slice]):
        self.x2, self.weight, self.eps, self.rstd, self.chunks = x2, weight, eps, rstd, chunks
        self.shape = x2.shape

    @classmethod
    def of(cls, x2: torch.Tensor, weight: torch.Tensor, eps: float, chunks: list[slice]) -> "NormedRows":
        """x2's rows normed by (weight, eps), read in `chunks` by linear_rows / add_weight_grad."""
        return cls(x2, weight, eps, rms_norm_rstd(x2, eps), chunks)

    def whole(self) -> torch.Tensor:
        """The norm's output of every row at once [n, h]: for a forward whose saved tensors are
        dropped (a checkpointed block's first forward), one norm pass instead of one per read."""
        return rms_norm_apply(self.x2, self.rstd, self.weight, self.eps)

    def __getitem__(self, c: slice) -> torch.Tensor:
        return rms_norm_apply(self.x2[c], self.rstd[c], self.weight, self.eps)

    def backward_in_place(self, grad: torch.Tensor) -> torch.Tensor:
        """grad [n, h] at the norm's output becomes the gradient at its input (in place); returns
        the weight's gradient [h] in the weight's dtype (this rank's tokens' part)."""
        return rms_norm_backward_in_place(self.x2, self.rstd, self.weight, grad).to(self.weight.dtype)


def linear_rows(rows: torch.Tensor | NormedRows, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """rows [n, h] @ weight^T (+ bias) -> [n, out]: one GEMM on a tensor, one per chunk of
    NormedRows (each chunk's normed rows [c, h] made and freed in turn)."""
    if isinstance(rows, torch.Tensor):
        return F.linear(rows, weight, bias)
    out = None
    for c in rows.chunks:
        xn = rows[c]                                                    # [c, h]
        if out is None:
            out = xn.new_empty((rows.shape[0], weight.shape[0]))
        if bias is None:
            torch.mm(xn, weight.t(), out=out[c])
        else:
            torch.addmm(bias, xn, weight.t(), out=out[c])
    return out


def add_weight_grad(acc: torch.Tensor, grad: torch.Tensor, rows: torch.Tensor | NormedRows) -> None:
    """acc [out, h] += grad [n, out]^T rows [n, h], summed inside the GEMM (add_matmul): one GEMM
    on a tensor, one per chunk of NormedRows."""
    if isinstance(rows, torch.Tensor):
        add_matmul(acc, grad.t(), rows)
        return
    for c in rows.chunks:
        add_matmul(acc, grad[c].t(), rows[c])
