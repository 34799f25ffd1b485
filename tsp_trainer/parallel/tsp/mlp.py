"""TSP gated MLP: rank p holds one block of the intermediate dim (rows of W_gate, W_up, columns of
W_down); the packed shards pass around the ring (tsp/ring.py), so the contraction over the
intermediate dim completes locally: no all-reduce.

Each ring step runs two GEMMs per token chunk (gate|up against the [W_gate; W_up] view, down_proj
added into the output: parallel/gated_mlp.py); backward writes the weight gradients straight into
the fp32 accumulator that travels home with each shard. Saved: X_p only, unless
`parallel.tsp_recompute=none` or a checkpoint replay keeps the gate/up pre-activations
(tsp/kept.py). down_proj's bias is replicated (its gradient summed in parallel/grad_sync.py).
The schedule and its memory: docs/parallelism.md, "TSP rings".
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from tsp_trainer.parallel.comm import Comm
from tsp_trainer.parallel.gated_mlp import (TokenTiling, fused_weights, gated_mlp_backward_into,
                                            gated_mlp_forward_into)
from tsp_trainer.parallel.grad_sync import ReplicatedGrads
from tsp_trainer.parallel.tsp.attention import _replicated, _weight_holder
from tsp_trainer.parallel.tsp.kept import Kept, kept_for_backward
from tsp_trainer.parallel.tsp.norm import NormedRows
from tsp_trainer.parallel.tsp.ring import pack, ring_backward_into, ring_forward, unpack


@dataclasses.dataclass(frozen=True, eq=False)
class MLPSettings:
    """What the MLP function takes besides tensors, fixed when the layer is built. Compared by
    identity: it is also the key of the layer's checkpoint slot (tsp/kept.py)."""

    comm: Comm
    tiling: TokenTiling


class TSPGatedMLP(nn.Module):
    """gate_proj/up_proj.weight [I/D, h], down_proj.weight [h, I/D] (names as model.GatedMLP);
    with mlp_bias gate_proj/up_proj.bias [I/D] (sharded) and down_proj.bias [h] (replicated).
    `tiling`: the local tokens' chunks and the accumulators' dtype (parallel/gated_mlp.py)."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, *, comm: Comm,
                 gate_up_bias: tuple[torch.Tensor, torch.Tensor] | None = None,
                 down_bias: torch.Tensor | None = None, keep_gate_up: bool = False,
                 tiling: TokenTiling | None = None, replay_keeps: bool = True,
                 replicated: ReplicatedGrads | None = None):
        super().__init__()
        self.keep_gate_up = keep_gate_up
        self.replay_keeps = replay_keeps     # under checkpointing: the replay keeps gate/up
        bg, bu = gate_up_bias if gate_up_bias is not None else (None, None)
        self.gate_proj, self.up_proj, self.down_proj = (
            _weight_holder(w, b) for w, b in ((gate, bg), (up, bu), (down, down_bias)))
        self.comm = comm
        self.replicated = _replicated(replicated, comm, self.down_proj.bias)
        self.tiling = tiling if tiling is not None else TokenTiling(inter_shard=gate.shape[0])
        self.settings = MLPSettings(comm, self.tiling)
        # the block's post-attention norm handing its work over (tsp/norm.py; set by apply_tsp)
        self.norm_handoff = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The ring's packed shard: W_gate, W_up, W_down [, b_gate, b_up]
        shard = [m.weight for m in (self.gate_proj, self.up_proj, self.down_proj)]
        if self.gate_proj.bias is not None:
            shard += [self.gate_proj.bias, self.up_proj.bias]
        # x is the norm's output, or its input when the norm handed its work over
        block_norm = self.norm_handoff.take() if self.norm_handoff is not None else None
        norm_w, norm_eps = block_norm if block_norm is not None else (None, None)
        y = _TSPMLPFn.apply(x, self.settings, kept_for_backward(self.keep_gate_up, self.replay_keeps),
                            norm_w, norm_eps, *shard)
        if self.down_proj.bias is None:
            return y
        return y + self.replicated.use(self.down_proj.bias)


class _TSPMLPFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, settings: MLPSettings, keep: Kept, norm_w, norm_eps, *params):
        # params: W_gate, W_up, W_down [, b_gate, b_up] (gated_mlp's argument order); norm_w [h],
        # norm_eps: the block's post-attention norm when it handed its work over (x is then its
        # input, normed per token chunk at every ring step), else None
        shapes = [tuple(w.shape) for w in params]
        fused = fused_weights(shapes)                    # [W_gate; W_up], W_down [, [b_gate; b_up]]
        chunks = settings.tiling.chunks(x)               # every ring step takes the same chunks
        y = torch.zeros(x.shape, dtype=settings.tiling.accumulator_dtype(x), device=x.device)
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, x.shape[-1])    # [n, h]
        rstd = None
        if norm_w is not None:          # a checkpointed block's first forward keeps nothing: one pass
            rows = NormedRows.of(x2, norm_w, norm_eps, chunks)
            x2, rstd = (rows.whole() if keep.first_forward else rows), rows.rstd
        # under none (or the AC replay): step j's gate/up pre-activations, [chunk, 2 I/D] each
        kept: dict[int, list] | None = {} if keep.items else None

        def step(j: int, flat: torch.Tensor) -> None:
            if kept is not None:
                kept[j] = []
            gated_mlp_forward_into(x2, unpack(flat, fused), y2, chunks,
                                   kept[j] if kept is not None else None)

        ring_forward(settings.comm, pack(*params), step, tag="mlp.weights")
        ctx.save_for_backward(x, norm_w, rstd, *params)
        ctx.shapes, ctx.settings, ctx.norm_eps = shapes, settings, norm_eps
        keep.store(ctx, settings, kept)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, norm_w, rstd, *params = ctx.saved_tensors
        kept = Kept.load(ctx, ctx.settings)
        tiling, h = ctx.settings.tiling, x.shape[-1]
        chunks = tiling.chunks(x)
        x2, dy2 = x.reshape(-1, h), dy.reshape(-1, h)                   # [n, h]
        if norm_w is not None:          # the norm's output, remade per chunk at every ring step
            x2 = NormedRows(x2, norm_w, ctx.norm_eps, rstd, chunks)
        dx = torch.zeros(x2.shape, dtype=tiling.accumulator_dtype(x), device=x.device)
        fused = fused_weights(ctx.shapes)

        def grad_into(j: int, flat: torch.Tensor, acc: torch.Tensor) -> None:
            # the weight (and gate/up bias) gradients go straight into the fp32 accumulator; a
            # kept step's gate|up pre-activations are released chunk by chunk as its gradient is done
            gated_mlp_backward_into(x2, dy2, unpack(flat, fused), unpack(acc, fused), dx,
                                    chunks, kept.pop(j) if kept is not None else None)

        full = ring_backward_into(ctx.settings.comm, pack(*params), grad_into, tag="mlp.weights")
        grads = (g.to(p.dtype) for g, p in zip(unpack(full, ctx.shapes), params))   # fp32 -> params'
        dx = dx.view(x.shape).to(x.dtype)
        # the norm's backward, in place: dX at its output -> at its input, and its weight's part
        norm_w_grad = None if norm_w is None else x2.backward_in_place(dx.view(-1, h))
        return (dx, None, None, norm_w_grad, None, *grads)
