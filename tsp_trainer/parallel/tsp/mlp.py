"""TSP gated MLP (docs/design.md; the TSP paper, https://arxiv.org/abs/2604.26294, section 4).

Rank p holds rows p*I/D.. of W_gate and W_up and the matching columns of W_down (one block of the
intermediate dim). Forward: the packed shard passes around the ring (batch_isend_irecv, posted
before the GEMMs so the transfer overlaps them); each step adds silu(X_p Wg_j^T) * (X_p Wu_j^T)
Wd_j^T to the local output. The contraction over the intermediate dim completes locally: no
all-reduce. Backward: the reverse ring carries an fp32 gradient accumulator with each shard, so the
full weight gradient, summed over the D ranks in fp32, ends at its owner (see tsp/ring.py); the
weight gradients are written straight into that accumulator (`gated_mlp_backward_into`), and the
accumulator sent at one step is the next step's receive buffer: 4 packed buffers per step. Saved:
X_p only; per-shard activations are recomputed in backward (the gate/up GEMMs run again), unless
`keep_gate_up` (parallel.tsp_recompute=none): then each ring step keeps its gate and up
pre-activations g_j, u_j [B, T, I/D] (2 T I elements per layer over the D steps) and backward runs
no GEMM of the forward. Under activation checkpointing the block's replay keeps them in every
mode and hands them to this backward (tsp/kept.py): the first forward keeps nothing, and gate/up
run twice per step (forward, replay), down_proj twice, as without checkpointing under full and
selective. With mlp_bias (Llama), the gate/up
biases of the block travel in the packed shard; down_proj's bias is replicated, added once per
token after the ring, and its gradient summed over the group in fp32 (like a norm's, tag
"bias.grad").
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tsp_trainer.model.layers import gated_mlp
from tsp_trainer.parallel.comm import Comm
from tsp_trainer.parallel.grad_sync import SumGradOverGroup
from tsp_trainer.parallel.tsp.attention import _weight_holder
from tsp_trainer.parallel.tsp.kept import Kept, kept_for_backward
from tsp_trainer.parallel.tsp.ring import add_matmul, pack, ring_backward_into, ring_forward, unpack


class TSPGatedMLP(nn.Module):
    """gate_proj/up_proj.weight [I/D, h], down_proj.weight [h, I/D] (names as model.GatedMLP);
    with mlp_bias gate_proj/up_proj.bias [I/D] (sharded) and down_proj.bias [h] (replicated)."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, *, comm: Comm,
                 gate_up_bias: tuple[torch.Tensor, torch.Tensor] | None = None,
                 down_bias: torch.Tensor | None = None, keep_gate_up: bool = False):
        super().__init__()
        self.keep_gate_up = keep_gate_up
        bg, bu = gate_up_bias if gate_up_bias is not None else (None, None)
        self.gate_proj, self.up_proj, self.down_proj = (
            _weight_holder(w, b) for w, b in ((gate, bg), (up, bu), (down, down_bias)))
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The ring's packed shard: W_gate, W_up, W_down [, b_gate, b_up]
        shard = [m.weight for m in (self.gate_proj, self.up_proj, self.down_proj)]
        if self.gate_proj.bias is not None:
            shard += [self.gate_proj.bias, self.up_proj.bias]
        y = _TSPMLPFn.apply(x, self.comm, self, kept_for_backward(self.keep_gate_up), *shard)
        if self.down_proj.bias is None:
            return y
        return y + SumGradOverGroup.apply(self.down_proj.bias, self.comm, "bias.grad", True)


class _TSPMLPFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm: Comm, block: TSPGatedMLP, keep: Kept, *params):
        # params: W_gate, W_up, W_down [, b_gate, b_up] (gated_mlp's argument order)
        shapes = [tuple(w.shape) for w in params]
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        kept: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = {} if keep.items else None

        def step(j: int, flat: torch.Tensor) -> None:
            ws = unpack(flat, shapes)
            if kept is None:
                y.add_(gated_mlp(x, *ws))
                return
            g, u = _gate_up(x, ws)                       # [B, T, I/D] each, kept for backward
            kept[j] = (g, u)
            y.add_(F.linear(F.silu(g) * u, ws[2]))      # = gated_mlp(x, *ws), same ops

        ring_forward(comm, pack(*params), step, tag="mlp.weights")
        ctx.save_for_backward(x, *params)
        ctx.comm, ctx.shapes, ctx.block = comm, shapes, block
        keep.store(ctx, block, kept)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, *params = ctx.saved_tensors
        kept = Kept.load(ctx, ctx.block)
        h = x.shape[-1]
        x2, dy2 = x.reshape(-1, h), dy.reshape(-1, h)                   # [n, h]
        dx = torch.zeros(x2.shape, dtype=torch.float32, device=x.device)

        def grad_into(j: int, flat: torch.Tensor, acc: torch.Tensor) -> None:
            # the weight (and gate/up bias) gradients go straight into the fp32 accumulator; a
            # kept step's g, u are released as soon as its gradient is done
            gate_up = kept.pop(j) if kept is not None else None
            gated_mlp_backward_into(x2, dy2, unpack(flat, ctx.shapes), unpack(acc, ctx.shapes), dx,
                                    gate_up=gate_up)

        full = ring_backward_into(ctx.comm, pack(*params), grad_into, tag="mlp.weights")
        grads = (g.to(p.dtype) for g, p in zip(unpack(full, ctx.shapes), params))   # fp32 -> params'
        return (dx.view(x.shape).to(x.dtype), None, None, None, *grads)


def _gate_up(x: torch.Tensor, ws: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up pre-activations x W_gate^T (+ b_gate), x W_up^T (+ b_up) of one block."""
    bg, bu = (ws[3], ws[4]) if len(ws) > 3 else (None, None)
    return F.linear(x, ws[0], bg), F.linear(x, ws[1], bu)


def gated_mlp_backward_into(x: torch.Tensor, dy: torch.Tensor, ws: list[torch.Tensor],
                            acc: list[torch.Tensor], dx: torch.Tensor,
                            gate_up: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Backward of `gated_mlp` for one block of the intermediate dim, by hand so that the weight
    gradients are added into `acc` (fp32 views of the ring's packed accumulator) without a
    gradient tensor of their own. x, dy [n, h]; ws = W_gate, W_up [I/D, h], W_down [h, I/D]
    (+ b_gate, b_up [I/D]); acc the same shapes in fp32; dx [n, h] fp32 (added into).
    gate_up: the block's kept pre-activations g, u (any shape of n x I/D elements); None
    recomputes them from x (TSP saves only X_p by default)."""
    wg, wu, wd = ws[:3]
    bg = ws[3] if len(ws) > 3 else None
    if gate_up is None:
        gate_up = _gate_up(x, ws)
    g, u = (t.reshape(x.shape[0], -1) for t in gate_up)     # [n, I/D] gate, up pre-activations
    sig = torch.sigmoid(g)
    a = g * sig                                  # silu(g)
    add_matmul(acc[2], dy.t(), a * u)           # dW_down [h, I/D] = dy^T (silu(g) * u)
    dp = dy @ wd                                 # [n, I/D] gradient of silu(g) * u
    du = dp * a
    dg = dp.mul_(u).mul_(sig * (1 + g * (1 - sig)))    # silu'(g) = sig (1 + g (1 - sig))
    add_matmul(acc[0], dg.t(), x)               # dW_gate [I/D, h]
    add_matmul(acc[1], du.t(), x)               # dW_up [I/D, h]
    if bg is not None:
        acc[3].add_(dg.sum(0, dtype=torch.float32))
        acc[4].add_(du.sum(0, dtype=torch.float32))
    dx.add_(dg @ wg).add_(du @ wu)

