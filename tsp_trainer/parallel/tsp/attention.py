"""TSP attention (docs/design.md; the TSP paper, https://arxiv.org/abs/2604.26294, section 3).

Rank p of D holds rows of W_q, W_k, W_v for head group p and the matching columns of W_o, and the
N/D tokens X_p of its two zigzag chunks. The work is a schedule of items (r, b): owner r's shard,
head bucket b, in the same order on every rank. For each item every rank projects its local tokens
with shard r, all-gathers K and V over the tsp group, reorders them to logical order, runs causal
attention for its local queries and accumulates A_(r,b) W_o^(r,b)T into its output. The sum over
heads completes locally: no all-reduce. q/k/v biases (Qwen2, Llama attention_bias) belong to their
heads: they are packed into the same broadcast shard as W_q, W_k, W_v, W_o. The o_proj bias is
replicated and added once per token after the sum; its gradient is summed over the group (like a
norm's, tag "bias.grad").

Overlap. Every transfer is asynchronous and issued one step ahead of the compute that
needs it, in the same order on every rank (tests/distributed/test_tsp_overlap.py checks the order):
- weights: owner r's shard is broadcast into a fixed pool of buffers (tsp/ring.py ShardBroadcasts),
  the next shards in flight while shard r is used;
- K/V: item i+1's projection is computed and its all-gather issued before item i's attention, so
  the gather runs under the attention kernel (forward and backward);
- dK/dV: backward issues item i's reduce-scatter, then computes the query side (dW_o, dW_q, dX from
  dQ) and, under full recompute, item i+1's attention forward while it runs; only then it waits
  for it and finishes item i's key/value side, before item i+1's projection and K/V gather (so at
  most two weight shards and two gradient buffers are held, as without the deferral);
- weight gradients: this rank's partial gradient of shard r is written straight into a packed fp32
  buffer (no per-weight gradient tensors) and reduced to owner r asynchronously while shard r+1 is
  computed; the buffer that reduce frees is the next one filled.
On CUDA these are NCCL ops on NCCL's stream: `wait()` orders the compute stream after them without
blocking the host, so the transfers run beside the kernels.

Transient memory per block (packed shards P_attn / D; fp32 weights): forward three weight buffers;
backward two weight buffers and two fp32 gradient buffers (the one filled, the one being reduced):
4 shards (test_tsp_memory.py), plus two gathered K/V buckets (the one in use, the next one in flight)
and one gathered dK/dV bucket. The output (forward) and dX (backward) accumulators [N/D, h] are
fp32, or the activation dtype once the layer's tokens are tiled (`parallel.mlp_chunk_tokens`,
parallel/gated_mlp.py): in bf16 each item's product, summed in fp32 inside its matmul, is then
rounded as it is added, and the block holds no fp32 [N/D, h].

Recompute (`parallel.tsp_recompute`):
- "full" (default): saved between forward and backward: X_p only. Backward re-broadcasts shard r,
  recomputes the local projections and the bucket's attention forward, then backpropagates.
- "selective": forward also keeps, per item, the local q and stacked k, v (after RoPE) and the
  attention output with its autograd graph, whose saved views of the gathered K/V are dropped (a
  saved-tensor hook keeps only their geometry) and re-gathered from the local k, v in backward. So
  backward runs no projection forward and no attention forward: it re-broadcasts the weights (for
  dX and the weight gradients) and re-gathers K/V. Extra saved bytes per layer and rank: about
  (2 q + 2 k/v + the kernel's output + log-sum-exp) tokens x heads of this rank's tokens, i.e. ~5
  X_p for multi-head attention (tsp-plan models it).
- "none": the attention keeps what selective keeps; the MLP (tsp/mlp.py) also keeps its gate/up
  pre-activations, so no GEMM of the forward runs again in backward.
Under activation checkpointing (model/activation_checkpoint.py) the block's replay is the
recompute, whatever the mode (tsp/kept.py): the first forward keeps nothing (X_p is the
checkpoint's to drop). With `parallel.checkpoint_replay_keeps` all or attention the replay keeps
the items as selective does and hands them through the checkpointed call's slot to this
function's backward, which then runs as selective's (weights re-broadcast for dX and the weight
gradients, K/V re-gathered, no projection or attention forward): per item and step two attention
forwards (forward, replay) and one backward, as full recompute without checkpointing. With
nothing the replay puts None and the backward runs full recompute's path (projections and
attention forward again): three forwards, and no block's items held. Selective and none without
checkpointing run one forward.
The backward by hand (RoPE's adjoint, the projections' matmuls into the packed gradient) is the same
in every mode; it reduces this rank's partial weight gradients to owner r in fp32 (the sum over D
ranks is not rounded to bf16 on the way).
"""

from __future__ import annotations

import contextlib
import typing

import torch
import torch.nn as nn

from tsp_trainer.config.schema import TspRecompute
from tsp_trainer.model.layers import Rotary, apply_rope, attention_core
from tsp_trainer.model.rope import apply_rope_backward
from tsp_trainer.parallel import zigzag
from tsp_trainer.parallel.comm import Comm
from tsp_trainer.parallel.gated_mlp import TokenTiling, add_matmul
from tsp_trainer.parallel.grad_sync import SumGradOverGroup
from tsp_trainer.parallel.tsp.kept import Kept, kept_for_backward
from tsp_trainer.parallel.tsp.ring import ShardBroadcasts, unpack

RECOMPUTE_MODES = typing.get_args(TspRecompute)   # parallel.tsp_recompute (module docstring)


class TSPAttention(nn.Module):
    """Attention block of one TSP rank. Parameter names and (sharded) shapes mirror
    model.layers.Attention so state dicts line up: q_proj.weight [n_h/D * d, h], k_proj/v_proj
    [n_kv/D * d, h], o_proj.weight [h, n_h/D * d]; with biases q_proj.bias [n_h/D * d],
    k_proj/v_proj.bias [n_kv/D * d] (sharded) and o_proj.bias [h] (replicated). `tiling`: the
    layer's token tiling (its MLP's, parallel/gated_mlp.py): once the layer's tokens are tiled the
    output and dX accumulate in the activation dtype."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, *,
                 head_dim: int, comm: Comm, head_buckets: int = 1, recompute: str = "full",
                 qkv_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 o_bias: torch.Tensor | None = None, tiling: TokenTiling | None = None,
                 replay_keeps: bool = True):
        super().__init__()
        self.replay_keeps = replay_keeps     # under checkpointing: the replay keeps the items
        self.tiling = tiling if tiling is not None else TokenTiling()
        bq, bk, bv = qkv_bias if qkv_bias is not None else (None, None, None)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            _weight_holder(w, b) for w, b in ((q, bq), (k, bk), (v, bv), (o, o_bias)))
        self.head_dim, self.comm, self.head_buckets = head_dim, comm, head_buckets
        n_kv_local = k.shape[0] // head_dim
        if n_kv_local % head_buckets:
            raise ValueError(f"parallel.head_buckets={head_buckets} must divide the KV heads per "
                             f"rank ({n_kv_local})")
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(f"parallel.tsp_recompute={recompute!r} is not one of {RECOMPUTE_MODES}")
        self.recompute = recompute

    def forward(self, x: torch.Tensor, rope: Rotary) -> torch.Tensor:
        # The shard's parameters, in packing order: W_q, W_k, W_v, W_o [, b_q, b_k, b_v]
        shard = [m.weight for m in (self.q_proj, self.k_proj, self.v_proj, self.o_proj)]
        if self.q_proj.bias is not None:
            shard += [self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]
        # the items are kept under selective and none, and by a checkpoint replay that keeps them
        kept = kept_for_backward(self.recompute != "full", self.replay_keeps)
        y = _TSPAttentionFn.apply(x, rope, self, kept, *shard)
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


def _schedule(degree: int, buckets: int) -> list[tuple[int, int]]:
    """The items (owner r, head bucket b), in the order every rank runs them."""
    return [(r, b) for r in range(degree) for b in range(buckets)]


class _KVGather:
    """One item's K/V all-gather in flight. kv: this rank's [B, T, 2, H, d] (K and V stacked, after
    RoPE); wait() -> the logical-order [B, S, 2, H, d] of the whole group."""

    def __init__(self, kv: torch.Tensor, comm: Comm):
        self.kv, self.comm = kv, comm                  # kv stays referenced until the gather is done
        self.out = kv.new_empty((comm.size * kv.shape[0],) + kv.shape[1:])
        self.work = comm.all_gather(self.out, kv, tag="attn.kv", async_op=True)

    def wait(self) -> torch.Tensor:
        self.work.wait()
        full = zigzag.gathered_to_logical(self.out.view((self.comm.size,) + self.kv.shape))
        self.out = None
        return full


class _DKVScatter:
    """Inverse of _KVGather, in flight: sum dK, dV [B, S, H, d] each over the group; wait() -> this
    rank's tokens' dK, dV [B, T, H, d] each."""

    def __init__(self, dk: torch.Tensor, dv: torch.Tensor, comm: Comm):
        self.inp = zigzag.pair_to_gathered(dk, dv, comm.size)          # [D, B, T, 2, H, d], one copy
        self.out = self.inp.new_empty(self.inp.shape[1:])
        self.work = comm.reduce_scatter(self.out, self.inp.view((-1,) + self.inp.shape[2:]),
                                        tag="attn.dkv", async_op=True)

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.work.wait()
        self.inp = None
        return self.out[:, :, 0], self.out[:, :, 1]


class _KVEntry(torch.autograd.Function):
    """Where the gathered K/V [B, S, 2, H, d] enter an item's attention graph, as the views K and
    V [B, S, H, d]. Their gradients are handed to `sink` (a list) instead of to a leaf tensor, so
    the graph holds no reference to the gathered K/V: with selective recompute their memory is
    freed after the forward kernel (the kernel's saved views are swapped out by _DroppedKV) and
    backward works from a re-gathered copy. dK and dV arrive apart and stay apart (autograd's
    select backward would zero-fill a [B, S, 2, H, d] tensor per view and add the two)."""

    @staticmethod
    def forward(ctx, anchor, kv, sink: list):
        ctx.sink = sink
        return kv[:, :, 0], kv[:, :, 1]

    @staticmethod
    def backward(ctx, dk, dv):
        ctx.sink.append((dk, dv))
        return torch.zeros((), dtype=dk.dtype, device=dk.device), None, None


class _DroppedKV:
    """Saved-tensor hooks (selective recompute): a tensor the attention kernel saves that is a view
    of the gathered K/V `kv` is kept as its geometry (size, stride, offset) only; in backward it is
    rebuilt as the same view of `regathered` (the K/V gathered again, same layout)."""

    def __init__(self, kv: torch.Tensor):
        self.kv = kv if kv._base is None else kv._base   # views chain to their root tensor
        self.regathered = None

    def pack(self, t: torch.Tensor):
        if t is self.kv or t._base is self.kv:
            return (tuple(t.shape), t.stride(), t.storage_offset())
        return t

    def unpack(self, saved):
        if isinstance(saved, torch.Tensor):
            return saved
        size, stride, offset = saved
        return self.regathered.as_strided(size, stride, offset)


class _Item:
    """One item's activations: q [B, T, hq_b, d] and the stacked local k, v [B, T, 2, hkv_b, d]
    (after RoPE), the K/V all-gather in flight, and once attended the output a [B, T, hq_b * d]
    with its autograd graph (q_leaf, the gradient sink of the gathered K/V, the K/V hooks)."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm):
        self.q, self.kv, self.comm = q, torch.stack((k, v), dim=2), comm
        self.gather: _KVGather | None = _KVGather(self.kv, comm)
        self.a = self.q_leaf = self.anchor = self.sink = self.dropped = None

    def regather(self) -> None:
        """Issue the K/V all-gather again (selective recompute's backward)."""
        self.gather = _KVGather(self.kv, self.comm)

    def attend(self, rope: Rotary, *, graph: bool, drop_kv: bool = False) -> torch.Tensor:
        """Wait for the gathered K/V and compute a = attention(q, K, V); with graph=True record the
        autograd graph from q and the K/V entry (drop_kv: without keeping the gathered K/V)."""
        full = self.gather.wait()
        self.gather = None
        if not graph:
            return attention_core(self.q, full[:, :, 0], full[:, :, 1], rope.runs, documents=rope.documents)
        self.q_leaf, self.sink = self.q.detach().requires_grad_(), []
        self.anchor = torch.zeros((), dtype=full.dtype, device=full.device, requires_grad=True)
        hooks = contextlib.nullcontext()
        # drop_kv's hooks are innermost, so the graph's saved tensors never reach an activation
        # checkpoint's hooks (the replay records this graph inside the checkpoint's recomputation)
        with torch.enable_grad():
            k, v = _KVEntry.apply(self.anchor, full, self.sink)
            if drop_kv:
                self.dropped = _DroppedKV(full)
                hooks = torch.autograd.graph.saved_tensors_hooks(self.dropped.pack, self.dropped.unpack)
            with hooks:
                self.a = attention_core(self.q_leaf, k, v, rope.runs, documents=rope.documents)
        if drop_kv:
            self.dropped.kv = None                       # nothing refers to the gathered K/V now
        return self.a

    def backward(self, da: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """dQ [B, T, hq_b, d] and (dK, dV) [B, S, hkv_b, d] each (logical order, before the sum
        over the group) of the recorded attention; with dropped K/V, waits for the re-gathered
        copy."""
        if self.dropped is not None:
            self.dropped.regathered = self.gather.wait()
            self.gather = None
        dq, _ = torch.autograd.grad(self.a, (self.q_leaf, self.anchor), da)
        dkv = self.sink.pop()
        self.a = self.q_leaf = self.anchor = self.sink = self.dropped = None   # the graph is spent
        return dq, dkv


def _project_item(x: torch.Tensor, shards: ShardBroadcasts, item: tuple[int, int], block: TSPAttention,
                  shapes, rope: Rotary) -> _Item:
    """Item (r, b): project the local tokens with bucket b of shard r (waiting for its broadcast
    if needed) and issue the item's K/V all-gather."""
    r, b = item
    wq, wk, wv, _, bq, bk, bv = _Shard(shards.get(r), block, shapes).bucket(b)
    return _Item(*_project(x, wq, wk, wv, bq, bk, bv, rope, block.head_dim), block.comm)


class _TSPAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rope: Rotary, block: TSPAttention, keep: Kept, *params):
        # params: W_q, W_k, W_v, W_o [, b_q, b_k, b_v] of this rank's heads (one packed shard)
        comm, shapes = block.comm, [tuple(w.shape) for w in params]
        items = _schedule(comm.size, block.head_buckets)
        selective = keep.items               # record each item's attention graph for backward
        shards = ShardBroadcasts(comm, list(params), buffers=3, tag="attn.weights")

        def prepare(i: int) -> _Item:           # project item i, issue its K/V all-gather
            return _project_item(x, shards, items[i], block, shapes, rope)

        # the sum over items: fp32, or x's dtype once the layer's tokens are tiled
        y = torch.zeros(x.shape, dtype=block.tiling.accumulator_dtype(x), device=x.device)
        kept, nxt = [], prepare(0)
        for i, (r, b) in enumerate(items):
            item, nxt = nxt, (prepare(i + 1) if i + 1 < len(items) else None)   # next gather in flight
            wo = _Shard(shards.get(r), block, shapes).bucket(b)[3]
            a = item.attend(rope, graph=selective, drop_kv=selective)
            y += a.detach() @ wo.T
            if selective:
                kept.append(item)
            if b == block.head_buckets - 1:
                shards.release(r)
        ctx.save_for_backward(x, *params)
        ctx.rope, ctx.block, ctx.shapes = rope, block, shapes
        keep.store(ctx, block, kept if selective else None)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, *params = ctx.saved_tensors
        block, comm, shapes, rope = ctx.block, ctx.block.comm, ctx.shapes, ctx.rope
        items, kept = _schedule(comm.size, block.head_buckets), Kept.load(ctx, block)
        shards = ShardBroadcasts(comm, params, buffers=2, tag="attn.weights")
        grads = _GradReduces(comm, sum(p.numel() for p in params), x.device)
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])     # [n, h]
        dx = torch.zeros(x2.shape, dtype=block.tiling.accumulator_dtype(x), device=x.device)

        def prepare(i: int) -> _Item:           # item i's activations, its K/V gather in flight
            if kept is not None:
                kept[i].regather()
                return kept[i]
            return _project_item(x, shards, items[i], block, shapes, rope)

        def finish(pending: _PendingKV | None) -> None:   # an item's key/value side, then its shard
            if pending is None:
                return
            pending.finish(x2, rope, dx)
            if pending.bucket == block.head_buckets - 1:
                shards.release(pending.owner)
                grads.reduce(pending.owner)

        item, pending = prepare(0), None
        for i, (r, b) in enumerate(items):
            if kept is None:
                item.attend(rope, graph=True)    # full recompute: the attention forward again,
            finish(pending)                      # under which item i-1's dK/dV were reduce-scattered
            nxt = prepare(i + 1) if i + 1 < len(items) else None    # its K/V gather in flight
            weights = _Shard(shards.get(r), block, shapes).bucket(b)
            grad = _Shard(grads.buffer(r), block, shapes).bucket(b)
            pending = _item_query_side(x2, dy2, item, weights, grad, rope, block, dx, owner=r, bucket=b)
            item = nxt
        finish(pending)
        own_grad = grads.finish()
        out = (g.to(p.dtype) for g, p in zip(unpack(own_grad, shapes), params))   # fp32 -> params'
        return (dx.view(x.shape).to(x.dtype), None, None, None, *out)


class _GradReduces:
    """This rank's partial fp32 gradient of each owner's shard, reduced to the owner asynchronously
    while the next shard is computed. Buffers are reused: at any time one is being filled and one
    is being reduced (besides the result, this rank's own shard's full gradient)."""

    def __init__(self, comm: Comm, numel: int, device):
        self.comm, self.numel, self.device = comm, numel, device
        self._filling: dict[int, torch.Tensor] = {}
        self._pool: list[torch.Tensor] = []
        self._pending = None
        self._own: torch.Tensor | None = None

    def buffer(self, r: int) -> torch.Tensor:
        """The packed fp32 buffer into which shard r's gradients are written (zeroed once)."""
        if r not in self._filling:
            buf = self._pool.pop() if self._pool else torch.empty(
                self.numel, dtype=torch.float32, device=self.device)
            self._filling[r] = buf.zero_()
        return self._filling[r]

    def reduce(self, r: int) -> None:
        """Shard r's partial gradient is complete: sum it into owner r (asynchronously), then
        finish the previous reduce and recycle its buffer."""
        buf = self._filling.pop(r)
        work = self.comm.reduce(buf, dst=r, tag="attn.wgrad", async_op=True)
        self._finish_pending()
        self._pending = (r, buf, work)

    def _finish_pending(self) -> None:
        if self._pending is None:
            return
        r, buf, work = self._pending
        work.wait()
        if r == self.comm.rank:
            self._own = buf
        else:
            self._pool.append(buf)
        self._pending = None

    def finish(self) -> torch.Tensor:
        """The full fp32 gradient of this rank's shard (summed over the group)."""
        self._finish_pending()
        return self._own


class _PendingKV:
    """An item whose dK/dV reduce-scatter is in flight: its key/value side (this rank's dW_k,
    dW_v, q/k/v bias and dX contributions) runs once the scatter is waited for."""

    def __init__(self, scatter: _DKVScatter, weights, grads, *, owner: int, bucket: int):
        self.scatter, self.owner, self.bucket = scatter, owner, bucket
        self.wk, self.wv, self.gk, self.gv, self.gbk, self.gbv = (weights[1], weights[2], grads[1],
                                                                  grads[2], grads[5], grads[6])

    def finish(self, x2: torch.Tensor, rope: Rotary, dx: torch.Tensor) -> None:
        dk, dv = self.scatter.wait()
        _linear_backward(x2, apply_rope_backward(dk, rope.cos, rope.sin), self.wk, self.gk, self.gbk, dx)
        _linear_backward(x2, dv, self.wv, self.gv, self.gbv, dx)


def _item_query_side(x2, dy2, item: _Item, weights, grads, rope: Rotary, block: TSPAttention,
                     dx: torch.Tensor, *, owner: int, bucket: int) -> _PendingKV:
    """Backpropagate dy through one item whose attention graph is recorded, up to its dK/dV: add
    this rank's partial dW_o, dW_q (and q bias) into `grads` (fp32 views of the packed gradient)
    and dX_p's query-side contribution into dx [n, h] (fp32, or x's dtype when tiled), and issue the dK/dV reduce-scatter,
    whose key/value side the returned _PendingKV finishes later. weights, grads: (wq, wk, wv, wo,
    bq, bk, bv) of the bucket, biases None without q/k/v biases. x2, dy2: [n, h] (n = B * T local
    tokens)."""
    wq, wk, wv, wo, *_ = weights
    gq, gk, gv, go, gbq, gbk, gbv = grads
    a = item.a
    add_matmul(go, dy2.t(), a.reshape(dy2.shape[0], -1))                # dW_o += dy^T A
    dq, dkv = item.backward((dy2 @ wo).view(a.shape))                   # dA = dy W_o
    scatter = _DKVScatter(*dkv, block.comm)                             # dK/dV summed meanwhile
    del dkv
    # the query side while dK/dV are reduce-scattered
    _linear_backward(x2, apply_rope_backward(dq, rope.cos, rope.sin), wq, gq, gbq, dx)
    return _PendingKV(scatter, weights, grads, owner=owner, bucket=bucket)


def _linear_backward(x2: torch.Tensor, dp: torch.Tensor, w: torch.Tensor, gw: torch.Tensor,
                     gb: torch.Tensor | None, dx: torch.Tensor) -> None:
    """Backward of p = x W^T (+ b) for one projection of one bucket: dp [B, T, heads, d] ->
    gw += dp^T x, gb += sum of dp (fp32), dx += dp W (in place)."""
    dp2 = dp.reshape(x2.shape[0], -1)                                   # [n, heads * d]
    add_matmul(gw, dp2.t(), x2)
    if gb is not None:
        gb.add_(dp2.sum(0, dtype=torch.float32))
    dx.add_(dp2 @ w)
