"""TSP attention (DESIGN.md section 3; TSP_PAPER.md section 3).

Rank p of D holds rows of W_q, W_k, W_v for head group p and the matching columns of W_o, and the
N/D tokens X_p of its two zigzag chunks. Forward, for r = 0..D-1 (the same order on every rank):
owner r broadcasts its packed shard (shard r+1 prefetched meanwhile); every rank projects its local
tokens with it, all-gathers K and V over the tsp group (per head bucket), reorders them to logical
order, runs causal attention for its local queries and accumulates A_r W_o^(r)T into its output.
The sum over heads completes locally: no all-reduce. q/k/v biases (Qwen2, Llama attention_bias)
belong to their heads: they are packed into the same broadcast shard as W_q, W_k, W_v, W_o. The
o_proj bias is replicated and added once per token after the sum; its gradient is summed over the
group (like a norm's, tag "bias.grad").

Backward re-broadcasts shard r, recomputes the local projections and the bucket's attention,
reduce-scatters dK, dV back to the ranks that own those tokens, and reduces this rank's partial
weight gradients (from its own tokens) to owner r, in fp32 (the sum over D ranks is not rounded
to bf16 on the way). Saved between forward and backward: X_p only.
Transient memory: two weight shards (P_attn / D each), one gathered K/V bucket and, in backward,
one gathered dK/dV bucket and one packed partial gradient in flight.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tsp_trainer.model.layers import Rotary, apply_rope, attention_core
from tsp_trainer.parallel import zigzag
from tsp_trainer.parallel.comm import Comm
from tsp_trainer.parallel.grad_sync import SumGradOverGroup
from tsp_trainer.parallel.tsp.ring import broadcast_shards, pack, unpack


class TSPAttention(nn.Module):
    """Attention block of one TSP rank. Parameter names and (sharded) shapes mirror
    model.layers.Attention so state dicts line up: q_proj.weight [n_h/D * d, h], k_proj/v_proj
    [n_kv/D * d, h], o_proj.weight [h, n_h/D * d]; with biases q_proj.bias [n_h/D * d],
    k_proj/v_proj.bias [n_kv/D * d] (sharded) and o_proj.bias [h] (replicated)."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, *,
                 head_dim: int, comm: Comm, head_buckets: int = 1,
                 qkv_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 o_bias: torch.Tensor | None = None):
        super().__init__()
        bq, bk, bv = qkv_bias if qkv_bias is not None else (None, None, None)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            _weight_holder(w, b) for w, b in ((q, bq), (k, bk), (v, bv), (o, o_bias)))
        self.head_dim, self.comm, self.head_buckets = head_dim, comm, head_buckets
        n_kv_local = k.shape[0] // head_dim
        if n_kv_local % head_buckets:
            raise ValueError(f"parallel.head_buckets={head_buckets} must divide the KV heads per "
                             f"rank ({n_kv_local})")

    def forward(self, x: torch.Tensor, rope: Rotary) -> torch.Tensor:
        # The shard's parameters, in packing order: W_q, W_k, W_v, W_o [, b_q, b_k, b_v]
        shard = [m.weight for m in (self.q_proj, self.k_proj, self.v_proj, self.o_proj)]
        if self.q_proj.bias is not None:
            shard += [self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]
        y = _TSPAttentionFn.apply(x, rope, self, *shard)
        if self.o_proj.bias is None:
            return y
        return y + SumGradOverGroup.apply(self.o_proj.bias, self.comm, "bias.grad", True)


def _weight_holder(w: torch.Tensor, b: torch.Tensor | None = None) -> nn.Module:
    """A submodule with `.weight` (and `.bias`, None when absent), so names match nn.Linear's."""
    m = nn.Module()
    m.weight = nn.Parameter(w)
    m.bias = None if b is None else (b if isinstance(b, nn.Parameter) else nn.Parameter(b))
    return m


class _Shard:
    """Views of one packed attention shard (W_q, W_k, W_v, W_o [, b_q, b_k, b_v]), split into head
    buckets."""

    def __init__(self, flat: torch.Tensor, block: TSPAttention, shapes):
        parts = unpack(flat, shapes)
        self.wq, self.wk, self.wv, self.wo = parts[:4]
        self.bq, self.bk, self.bv = parts[4:] if len(parts) > 4 else (None, None, None)
        self.nb, self.d = block.head_buckets, block.head_dim

    def bucket(self, b: int) -> tuple[torch.Tensor | None, ...]:
        """(wq, wk, wv, wo, bq, bk, bv) of bucket b; the biases None without q/k/v biases."""
        q_rows = self.wq.shape[0] // self.nb
        kv_rows = self.wk.shape[0] // self.nb
        qs, ks = slice(b * q_rows, (b + 1) * q_rows), slice(b * kv_rows, (b + 1) * kv_rows)
        biases = (None,) * 3 if self.bq is None else (self.bq[qs], self.bk[ks], self.bv[ks])
        return (self.wq[qs], self.wk[ks], self.wv[ks], self.wo[:, qs]) + biases


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x @ w.T
    return y if b is None else y + b


def _project(x: torch.Tensor, wq, wk, wv, bq, bk, bv, rope: Rotary, d: int):
    """Local tokens through one bucket's projections (+ biases) + RoPE at their global positions.
    x [B, T, h] -> q [B, T, hq_b, d], k, v [B, T, hkv_b, d]."""
    b, t, _ = x.shape
    q = apply_rope(_linear(x, wq, bq).view(b, t, -1, d), rope.cos, rope.sin)
    k = apply_rope(_linear(x, wk, bk).view(b, t, -1, d), rope.cos, rope.sin)
    return q, k, _linear(x, wv, bv).view(b, t, -1, d)


def _gather_kv(k: torch.Tensor, v: torch.Tensor, comm: Comm):
    """All-gather the local K, V [B, T, H, d] over the tsp group -> logical-order [B, S, H, d] each."""
    kv = torch.stack((k, v), dim=2)                                    # [B, T, 2, H, d]
    out = kv.new_empty((comm.size * kv.shape[0],) + kv.shape[1:])
    comm.all_gather(out, kv, tag="attn.kv")
    full = zigzag.gathered_to_logical(out.view((comm.size,) + kv.shape))   # [B, S, 2, H, d]
    return full[:, :, 0], full[:, :, 1]


def _scatter_dkv(dk: torch.Tensor, dv: torch.Tensor, comm: Comm):
    """Inverse of _gather_kv: sum dK, dV [B, S, H, d] over the group, keep the local tokens."""
    dkv = zigzag.logical_to_gathered(torch.stack((dk, dv), dim=2), comm.size)   # [D, B, T, 2, H, d]
    out = dkv.new_empty(dkv.shape[1:])
    comm.reduce_scatter(out, dkv.view((-1,) + dkv.shape[2:]), tag="attn.dkv")
    return out[:, :, 0], out[:, :, 1]


class _TSPAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rope: Rotary, block: TSPAttention, *params):
        # params: W_q, W_k, W_v, W_o [, b_q, b_k, b_v] of this rank's heads (one packed shard)
        shapes = [tuple(w.shape) for w in params]
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)   # fp32 sum over r
        for _, flat in broadcast_shards(block.comm, pack(*params), tag="attn.weights"):
            shard = _Shard(flat, block, shapes)
            for b in range(block.head_buckets):
                wq, wk, wv, wo, bq, bk, bv = shard.bucket(b)
                q, k, v = _project(x, wq, wk, wv, bq, bk, bv, rope, block.head_dim)
                k_all, v_all = _gather_kv(k, v, block.comm)
                y += attention_core(q, k_all, v_all, rope.runs, documents=rope.documents) @ wo.T
        ctx.save_for_backward(x, *params)
        ctx.rope, ctx.block, ctx.shapes = rope, block, shapes
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, *params = ctx.saved_tensors
        block, comm = ctx.block, ctx.block.comm
        dx = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        own_grad, pending = None, None
        for r, flat in broadcast_shards(comm, pack(*params), tag="attn.weights"):
            shard = _Shard(flat, block, ctx.shapes)
            gflat = torch.zeros(flat.shape, dtype=torch.float32, device=flat.device)   # fp32 reduce
            gshard = _Shard(gflat, block, ctx.shapes)
            for b in range(block.head_buckets):
                dx += _bucket_backward(x, dy, shard.bucket(b), gshard.bucket(b), ctx.rope, block)
            if pending is not None:                 # overlap: reduce r-1 ran during compute of r
                own_grad = _finish_reduce(pending, comm, own_grad)
            pending = (r, gflat, comm.reduce(gflat, dst=r, tag="attn.wgrad", async_op=True))
        own_grad = _finish_reduce(pending, comm, own_grad)
        grads = (g.to(p.dtype) for g, p in zip(unpack(own_grad, ctx.shapes), params))   # fp32 -> params'
        return (dx.to(x.dtype), None, None, *grads)


def _finish_reduce(pending, comm: Comm, own_grad):
    r, gflat, work = pending
    work.wait()
    return gflat if r == comm.rank else own_grad


def _bucket_backward(x, dy, weights, grads, rope: Rotary, block: TSPAttention) -> torch.Tensor:
    """Recompute one bucket of shard r, backpropagate dy through it; write this rank's partial
    weight (and q/k/v bias) gradients into `grads` (views of the packed gradient) and return dX_p's
    contribution. weights, grads: (wq, wk, wv, wo, bq, bk, bv) of the bucket, biases maybe None."""
    comm, d = block.comm, block.head_dim
    with torch.enable_grad():
        xl = x.detach().requires_grad_()
        wl = [w.detach().requires_grad_() for w in weights if w is not None]   # wq, wk, wv, wo [, bq, bk, bv]
        wq, wk, wv, wo, *bqkv = wl
        q, k, v = _project(xl, wq, wk, wv, *(bqkv or (None,) * 3), rope, d)
        k_all, v_all = (t.detach().requires_grad_() for t in _gather_kv(k.detach(), v.detach(), comm))
        q_l = q.detach().requires_grad_()
        out = attention_core(q_l, k_all, v_all, rope.runs, documents=rope.documents) @ wo.T
        dq, dk_all, dv_all, dwo = torch.autograd.grad(out, (q_l, k_all, v_all, wo), dy)
        dk, dv = _scatter_dkv(dk_all, dv_all, comm)
        dxl, dwq, dwk, dwv, *dbqkv = torch.autograd.grad((q, k, v), (xl, wq, wk, wv, *bqkv), (dq, dk, dv))
    for g, dw in zip([g for g in grads if g is not None], (dwq, dwk, dwv, dwo, *dbqkv)):
        g.copy_(dw)
    return dxl
