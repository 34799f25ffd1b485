"""TSP gated MLP (DESIGN.md section 3; TSP_PAPER.md section 4).

Rank p holds rows p*I/D.. of W_gate and W_up and the matching columns of W_down (one block of the
intermediate dim). Forward: the packed shard passes around the ring (batch_isend_irecv, posted
before the GEMMs so the transfer overlaps them); each step adds silu(X_p Wg_j^T) * (X_p Wu_j^T)
Wd_j^T to the local output. The contraction over the intermediate dim completes locally: no
all-reduce. Backward: the reverse ring carries an fp32 gradient accumulator with each shard, so the
full weight gradient, summed over the D ranks in fp32, ends at its owner (see tsp/ring.py). Saved:
X_p only; per-shard activations are recomputed in backward. With mlp_bias (Llama), the gate/up
biases of the block travel in the packed shard; down_proj's bias is replicated, added once per
token after the ring, and its gradient summed over the group in fp32 (like a norm's, tag
"bias.grad").
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tsp_trainer.model.layers import gated_mlp
from tsp_trainer.parallel.comm import Comm
from tsp_trainer.parallel.grad_sync import SumGradOverGroup
from tsp_trainer.parallel.tsp.attention import _weight_holder
from tsp_trainer.parallel.tsp.ring import pack, ring_backward, ring_forward, unpack


class TSPGatedMLP(nn.Module):
    """gate_proj/up_proj.weight [I/D, h], down_proj.weight [h, I/D] (names as model.GatedMLP);
    with mlp_bias gate_proj/up_proj.bias [I/D] (sharded) and down_proj.bias [h] (replicated)."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, *, comm: Comm,
                 gate_up_bias: tuple[torch.Tensor, torch.Tensor] | None = None,
                 down_bias: torch.Tensor | None = None):
        super().__init__()
        bg, bu = gate_up_bias if gate_up_bias is not None else (None, None)
        self.gate_proj, self.up_proj, self.down_proj = (
            _weight_holder(w, b) for w, b in ((gate, bg), (up, bu), (down, down_bias)))
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The ring's packed shard: W_gate, W_up, W_down [, b_gate, b_up]
        shard = [m.weight for m in (self.gate_proj, self.up_proj, self.down_proj)]
        if self.gate_proj.bias is not None:
            shard += [self.gate_proj.bias, self.up_proj.bias]
        y = _TSPMLPFn.apply(x, self.comm, *shard)
        if self.down_proj.bias is None:
            return y
        return y + SumGradOverGroup.apply(self.down_proj.bias, self.comm, "bias.grad", True)


class _TSPMLPFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm: Comm, *params):
        # params: W_gate, W_up, W_down [, b_gate, b_up] (gated_mlp's argument order)
        shapes = [tuple(w.shape) for w in params]
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)

        def step(_j: int, flat: torch.Tensor) -> None:
            y.add_(gated_mlp(x, *unpack(flat, shapes)))

        ring_forward(comm, pack(*params), step, tag="mlp.weights")
        ctx.save_for_backward(x, *params)
        ctx.comm, ctx.shapes = comm, shapes
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, *params = ctx.saved_tensors
        dx = torch.zeros(x.shape, dtype=torch.float32, device=x.device)

        def grad_step(_j: int, flat: torch.Tensor) -> torch.Tensor:
            with torch.enable_grad():
                xl = x.detach().requires_grad_()
                ws = [w.detach().requires_grad_() for w in unpack(flat, ctx.shapes)]
                grads = torch.autograd.grad(gated_mlp(xl, *ws), (xl, *ws), dy)
            dx.add_(grads[0])
            return pack(*grads[1:]).float()      # the ring sums the D ranks' partials in fp32

        full = ring_backward(ctx.comm, pack(*params), grad_step, tag="mlp.weights")
        grads = (g.to(p.dtype) for g, p in zip(unpack(full, ctx.shapes), params))   # fp32 -> params'
        return (dx.to(x.dtype), None, *grads)
