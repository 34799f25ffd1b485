"""TSP attention (DESIGN.md section 3; TSP_PAPER.md section 3).

Rank p of D holds rows of W_q, W_k, W_v for head group p and the matching columns of W_o, and the
N/D tokens X_p of its two zigzag chunks. Forward, for r = 0..D-1 (the same order on every rank):
owner r broadcasts its packed shard (shard r+1 prefetched meanwhile); every rank projects its local
tokens with it, all-gathers K and V over the tsp group (per head bucket), reorders them to logical
order, runs causal attention for its local queries and accumulates A_r W_o^(r)T into its output.
The sum over heads completes locally: no all-reduce.

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
from tsp_trainer.parallel.tsp.ring import broadcast_shards, pack, unpack


class TSPAttention(nn.Module):
    """Attention block of one TSP rank. Parameter names and (sharded) shapes mirror
    model.layers.Attention so state dicts line up: q_proj.weight [n_h/D * d, h], k_proj/v_proj
    [n_kv/D * d, h], o_proj.weight [h, n_h/D * d]."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, *,
                 head_dim: int, comm: Comm, head_buckets: int = 1):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (_weight_holder(w) for w in (q, k, v, o))
        self.head_dim, self.comm, self.head_buckets = head_dim, comm, head_buckets
        n_kv_local = k.shape[0] // head_dim
        if n_kv_local % head_buckets:
            raise ValueError(f"parallel.head_buckets={head_buckets} must divide the KV heads per "
                             f"rank ({n_kv_local})")

    def forward(self, x: torch.Tensor, rope: Rotary) -> torch.Tensor:
        return _TSPAttentionFn.apply(x, self.q_proj.weight, self.k_proj.weight, self.v_proj.weight,
                                     self.o_proj.weight, rope, self)


def _weight_holder(w: torch.Tensor) -> nn.Module:
    m = nn.Module()
    m.weight = nn.Parameter(w)
    return m


class _Shard:
    """Views of one packed attention shard, split into head buckets."""

    def __init__(self, flat: torch.Tensor, block: TSPAttention, shapes):
        self.wq, self.wk, self.wv, self.wo = unpack(flat, shapes)
        self.nb, self.d = block.head_buckets, block.head_dim

    def bucket(self, b: int) -> tuple[torch.Tensor, ...]:
        q_rows = self.wq.shape[0] // self.nb
        kv_rows = self.wk.shape[0] // self.nb
        qs, ks = slice(b * q_rows, (b + 1) * q_rows), slice(b * kv_rows, (b + 1) * kv_rows)
        return self.wq[qs], self.wk[ks], self.wv[ks], self.wo[:, qs]


def _project(x: torch.Tensor, wq, wk, wv, rope: Rotary, d: int):
    """Local tokens through one bucket's projections + RoPE at their global positions.
    x [B, T, h] -> q [B, T, hq_b, d], k, v [B, T, hkv_b, d]."""
    b, t, _ = x.shape
    q = apply_rope((x @ wq.T).view(b, t, -1, d), rope.cos, rope.sin)
    k = apply_rope((x @ wk.T).view(b, t, -1, d), rope.cos, rope.sin)
    return q, k, (x @ wv.T).view(b, t, -1, d)


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
    def forward(ctx, x, wq, wk, wv, wo, rope: Rotary, block: TSPAttention):
        shapes = [tuple(w.shape) for w in (wq, wk, wv, wo)]
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)   # fp32 sum over r
        for _, flat in broadcast_shards(block.comm, pack(wq, wk, wv, wo), tag="attn.weights"):
            shard = _Shard(flat, block, shapes)
            for b in range(block.head_buckets):
                bq, bk, bv, bo = shard.bucket(b)
                q, k, v = _project(x, bq, bk, bv, rope, block.head_dim)
                k_all, v_all = _gather_kv(k, v, block.comm)
                y += attention_core(q, k_all, v_all, rope.runs) @ bo.T
        ctx.save_for_backward(x, wq, wk, wv, wo)
        ctx.rope, ctx.block, ctx.shapes = rope, block, shapes
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, wq, wk, wv, wo = ctx.saved_tensors
        block, comm = ctx.block, ctx.block.comm
        dx = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        own_grad, pending = None, None
        for r, flat in broadcast_shards(comm, pack(wq, wk, wv, wo), tag="attn.weights"):
            shard = _Shard(flat, block, ctx.shapes)
            gflat = torch.zeros(flat.shape, dtype=torch.float32, device=flat.device)   # fp32 reduce
            gshard = _Shard(gflat, block, ctx.shapes)
            for b in range(block.head_buckets):
                dx += _bucket_backward(x, dy, shard.bucket(b), gshard.bucket(b), ctx.rope, block)
            if pending is not None:                 # overlap: reduce r-1 ran during compute of r
                own_grad = _finish_reduce(pending, comm, own_grad)
            pending = (r, gflat, comm.reduce(gflat, dst=r, tag="attn.wgrad", async_op=True))
        own_grad = _finish_reduce(pending, comm, own_grad)
        dwq, dwk, dwv, dwo = (g.to(wq.dtype) for g in unpack(own_grad, ctx.shapes))
        return dx.to(x.dtype), dwq, dwk, dwv, dwo, None, None


def _finish_reduce(pending, comm: Comm, own_grad):
    r, gflat, work = pending
    work.wait()
    return gflat if r == comm.rank else own_grad


def _bucket_backward(x, dy, weights, grads, rope: Rotary, block: TSPAttention) -> torch.Tensor:
    """Recompute one bucket of shard r, backpropagate dy through it; write this rank's partial
    weight gradients into `grads` (views of the packed gradient) and return dX_p's contribution."""
    comm, d = block.comm, block.head_dim
    with torch.enable_grad():
        xl = x.detach().requires_grad_()
        wl = [w.detach().requires_grad_() for w in weights]          # wq, wk, wv, wo of the bucket
        q, k, v = _project(xl, wl[0], wl[1], wl[2], rope, d)
        k_all, v_all = (t.detach().requires_grad_() for t in _gather_kv(k.detach(), v.detach(), comm))
        q_l = q.detach().requires_grad_()
        out = attention_core(q_l, k_all, v_all, rope.runs) @ wl[3].T
        dq, dk_all, dv_all, dwo = torch.autograd.grad(out, (q_l, k_all, v_all, wl[3]), dy)
        dk, dv = _scatter_dkv(dk_all, dv_all, comm)
        dxl, dwq, dwk, dwv = torch.autograd.grad((q, k, v), (xl, wl[0], wl[1], wl[2]), (dq, dk, dv))
    for g, dw in zip(grads, (dwq, dwk, dwv, dwo)):
        g.copy_(dw)
    return dxl
