"""TSP gated MLP (docs/design.md; the TSP paper, https://arxiv.org/abs/2604.26294, section 4).

Rank p holds rows p*I/D.. of W_gate and W_up and the matching columns of W_down (one block of the
intermediate dim). Forward: the packed shard passes around the ring (batch_isend_irecv, posted
before the GEMMs so the transfer overlaps them); each step adds silu(X_p Wg_j^T) * (X_p Wu_j^T)
Wd_j^T to the local output, in two GEMMs: gate and up as one against [W_gate; W_up] (consecutive
rows of the packed shard, so a view; parallel/gated_mlp.py `fused_weights`), and down_proj added
into the output by the GEMM itself (`add_matmul`). The contraction over the intermediate dim
completes locally: no all-reduce. Backward: the reverse ring carries an fp32 gradient accumulator
with each shard, so the full weight gradient, summed over the D ranks in fp32, ends at its owner
(see tsp/ring.py); the weight gradients are written straight into that accumulator
(`gated_mlp_backward_into`), and the accumulator sent at one step is the next step's receive
buffer: 4 packed buffers per step. Per step: dW_down, dp = dy W_down, one GEMM for
[dW_gate; dW_up] into the accumulator's [W_gate; W_up] view and one for dX += [dg | du]
[W_gate; W_up], plus the gate|up GEMM again unless it was kept: 2 D GEMMs per layer forward, 5 D
backward (4 D under none; tests/distributed/test_gemm_launches.py). Saved: X_p only; per-shard
activations are recomputed in backward (the gate|up GEMM runs again), unless `keep_gate_up`
(parallel.tsp_recompute=none): then each ring step keeps its gate and up pre-activations
[g_j | u_j] [B T, 2 I/D] (2 T I elements per layer over the D steps) and backward runs no GEMM of
the forward. Under activation checkpointing, with `parallel.checkpoint_replay_keeps` all, the
block's replay keeps them in every mode and hands them to this backward (tsp/kept.py): the first
forward keeps nothing, and gate|up runs twice per step (forward, replay), down_proj twice, as
without checkpointing under full and selective. With attention or nothing the replay puts None and
this backward recomputes gate|up chunk by chunk (a third gate|up pass; [chunk, 2 I/D] alive
instead of the block's 2 T I).
With mlp_bias (Llama), the gate/up biases of the block travel in the packed shard; down_proj's
bias is replicated, added once per token after the ring, and its gradient summed over the group in
fp32 (like a norm's, tag "bias.grad").

Tiling (`parallel.mlp_chunk_tokens`, parallel/gated_mlp.py): within each ring step the local tokens
are taken in chunks, so the gate/up intermediates and their gradients are [chunk, I/D], forward
and backward (kept ones per chunk too). A shard serves every chunk before it moves on: the ring's
transfers are those of one chunk. Once tiled, the output and dX accumulate in the activation dtype
(no fp32 [N/D, h]).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tsp_trainer.parallel.comm import Comm
from tsp_trainer.parallel.gated_mlp import (TokenTiling, fused_weights, gated_mlp_backward_into,
                                            gated_mlp_forward_into)
from tsp_trainer.parallel.grad_sync import SumGradOverGroup
from tsp_trainer.parallel.tsp.attention import _weight_holder
from tsp_trainer.parallel.tsp.kept import Kept, kept_for_backward
from tsp_trainer.parallel.tsp.ring import pack, ring_backward_into, ring_forward, unpack


class TSPGatedMLP(nn.Module):
    """gate_proj/up_proj.weight [I/D, h], down_proj.weight [h, I/D] (names as model.GatedMLP);
    with mlp_bias gate_proj/up_proj.bias [I/D] (sharded) and down_proj.bias [h] (replicated).
    `tiling`: the local tokens' chunks and the accumulators' dtype (parallel/gated_mlp.py)."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, *, comm: Comm,
                 gate_up_bias: tuple[torch.Tensor, torch.Tensor] | None = None,
                 down_bias: torch.Tensor | None = None, keep_gate_up: bool = False,
                 tiling: TokenTiling | None = None, replay_keeps: bool = True):
        super().__init__()
        self.keep_gate_up = keep_gate_up
        self.replay_keeps = replay_keeps     # under checkpointing: the replay keeps gate/up
        bg, bu = gate_up_bias if gate_up_bias is not None else (None, None)
        self.gate_proj, self.up_proj, self.down_proj = (
            _weight_holder(w, b) for w, b in ((gate, bg), (up, bu), (down, down_bias)))
        self.comm = comm
        self.tiling = tiling if tiling is not None else TokenTiling(inter_shard=gate.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The ring's packed shard: W_gate, W_up, W_down [, b_gate, b_up]
        shard = [m.weight for m in (self.gate_proj, self.up_proj, self.down_proj)]
        if self.gate_proj.bias is not None:
            shard += [self.gate_proj.bias, self.up_proj.bias]
        y = _TSPMLPFn.apply(x, self.comm, self, kept_for_backward(self.keep_gate_up, self.replay_keeps),
                          *shard)
        if self.down_proj.bias is None:
            return y
        return y + SumGradOverGroup.apply(self.down_proj.bias, self.comm, "bias.grad", True)


class _TSPMLPFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm: Comm, block: TSPGatedMLP, keep: Kept, *params):
        # params: W_gate, W_up, W_down [, b_gate, b_up] (gated_mlp's argument order)
        shapes = [tuple(w.shape) for w in params]
        fused = fused_weights(shapes)                    # [W_gate; W_up], W_down [, [b_gate; b_up]]
        chunks = block.tiling.chunks(x)                  # every ring step takes the same chunks
        y = torch.zeros(x.shape, dtype=block.tiling.accumulator_dtype(x), device=x.device)
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, x.shape[-1])    # [n, h]
        # under none (or the AC replay): step j's gate/up pre-activations, [chunk, 2 I/D] each
        kept: dict[int, list] | None = {} if keep.items else None

        def step(j: int, flat: torch.Tensor) -> None:
            if kept is not None:
                kept[j] = []
            gated_mlp_forward_into(x2, unpack(flat, fused), y2, chunks,
                                   kept[j] if kept is not None else None)

        ring_forward(comm, pack(*params), step, tag="mlp.weights")
        ctx.save_for_backward(x, *params)
        ctx.comm, ctx.shapes, ctx.block = comm, shapes, block
        keep.store(ctx, block, kept)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, *params = ctx.saved_tensors
        kept = Kept.load(ctx, ctx.block)
        tiling, h = ctx.block.tiling, x.shape[-1]
        chunks = tiling.chunks(x)
        x2, dy2 = x.reshape(-1, h), dy.reshape(-1, h)                   # [n, h]
        dx = torch.zeros(x2.shape, dtype=tiling.accumulator_dtype(x), device=x.device)
        fused = fused_weights(ctx.shapes)

        def grad_into(j: int, flat: torch.Tensor, acc: torch.Tensor) -> None:
            # the weight (and gate/up bias) gradients go straight into the fp32 accumulator; a
            # kept step's gate|up pre-activations are released chunk by chunk as its gradient is done
            gated_mlp_backward_into(x2, dy2, unpack(flat, fused), unpack(acc, fused), dx,
                                    chunks, kept.pop(j) if kept is not None else None)

        full = ring_backward_into(ctx.comm, pack(*params), grad_into, tag="mlp.weights")
        grads = (g.to(p.dtype) for g, p in zip(unpack(full, ctx.shapes), params))   # fp32 -> params'
        return (dx.view(x.shape).to(x.dtype), None, None, None, *grads)
