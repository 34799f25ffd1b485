"""TSP gated MLP (DESIGN.md section 3; TSP_PAPER.md section 4).

Rank p holds rows p*I/D.. of W_gate and W_up and the matching columns of W_down (one block of the
intermediate dim). Forward: the packed shard passes around the ring (batch_isend_irecv, posted
before the GEMMs so the transfer overlaps them); each step adds silu(X_p Wg_j^T) * (X_p Wu_j^T)
Wd_j^T to the local output. The contraction over the intermediate dim completes locally: no
all-reduce. Backward: the reverse ring carries an fp32 gradient accumulator with each shard, so the
full weight gradient, summed over the D ranks in fp32, ends at its owner (see tsp/ring.py). Saved:
X_p only; per-shard activations are recomputed in backward.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tsp_trainer.model.layers import gated_mlp
from tsp_trainer.parallel.comm import Comm
from tsp_trainer.parallel.tsp.attention import _weight_holder
from tsp_trainer.parallel.tsp.ring import pack, ring_backward, ring_forward, unpack


class TSPGatedMLP(nn.Module):
    """gate_proj/up_proj.weight [I/D, h], down_proj.weight [h, I/D] (names as model.GatedMLP)."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, *, comm: Comm):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (_weight_holder(w) for w in (gate, up, down))
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _TSPMLPFn.apply(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight,
                               self.comm)


class _TSPMLPFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, wg, wu, wd, comm: Comm):
        shapes = [tuple(w.shape) for w in (wg, wu, wd)]
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)

        def step(_j: int, flat: torch.Tensor) -> None:
            y.add_(gated_mlp(x, *unpack(flat, shapes)))

        ring_forward(comm, pack(wg, wu, wd), step, tag="mlp.weights")
        ctx.save_for_backward(x, wg, wu, wd)
        ctx.comm, ctx.shapes = comm, shapes
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, wg, wu, wd = ctx.saved_tensors
        dx = torch.zeros(x.shape, dtype=torch.float32, device=x.device)

        def grad_step(_j: int, flat: torch.Tensor) -> torch.Tensor:
            with torch.enable_grad():
                xl = x.detach().requires_grad_()
                ws = [w.detach().requires_grad_() for w in unpack(flat, ctx.shapes)]
                grads = torch.autograd.grad(gated_mlp(xl, *ws), (xl, *ws), dy)
            dx.add_(grads[0])
            return pack(*grads[1:]).float()      # the ring sums the D ranks' partials in fp32

        full = ring_backward(ctx.comm, pack(wg, wu, wd), grad_step, tag="mlp.weights")
        dwg, dwu, dwd = (g.to(wg.dtype) for g in unpack(full, ctx.shapes))
        return dx.to(x.dtype), dwg, dwu, dwd, None
