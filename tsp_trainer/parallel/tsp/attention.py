"""TSP attention: each rank keeps its tokens and the attention weights come to them, one owner's
head group at a time, so the sum over heads completes locally and no activation is all-reduced.

Rank p holds W_q, W_k, W_v rows and W_o columns of head group p (q/k/v biases travel with them;
the o_proj bias is replicated, its gradient summed in parallel/grad_sync.py). The forward and the
hand-written backward run a schedule of items (owner r, head bucket b), the same on every rank,
each transfer issued one item ahead of the compute that hides it; `parallel.tsp_recompute` and
activation checkpointing decide what backward recomputes (tsp/kept.py). The schedule, its GEMMs,
its transient memory and the recompute modes: docs/parallelism.md, "TSP attention". Qwen3's
q_norm / k_norm (RMSNorm over each head's d channels, before RoPE) run inside the owner's
projection; their weights [d] are replicated and summed like the block norms.

K/V heads fewer than D (MQA, GQA above its K/V count): each rank's shard holds a copy of the one
K/V head its query heads use; the copies' gradients are summed over the D / n_kv ranks that share
it (`kv_replicated`, a ReplicatedGrads on that group). Owners sharing a head produce the same K/V,
so it is all-gathered once per sharing group (`_KVShare`), and its dK/dV summed over the group's
owners before one reduce-scatter, into the last sharer's gradient (the sum over the group makes
every copy's whole).
"""

from __future__ import annotations

import contextlib
import dataclasses
import typing

import torch
import torch.nn as nn

from tsp_trainer.config.schema import TspRecompute
from tsp_trainer.model.layers import Rotary, apply_rope, attention_core
from tsp_trainer.model.rms_norm import chunk_rows, rms_norm, rms_norm_grads
from tsp_trainer.model.rope import apply_rope_backward
from tsp_trainer.parallel import zigzag
from tsp_trainer.parallel.comm import Comm
from tsp_trainer.parallel.gated_mlp import TokenTiling, add_matmul
from tsp_trainer.parallel.grad_sync import ReplicatedGrads
from tsp_trainer.parallel.loss_chunks import resolve_attention_chunk_tokens, token_chunks
from tsp_trainer.parallel.tsp.chunked import ChunkedItem
from tsp_trainer.parallel.tsp.kept import Kept, kept_for_backward
from tsp_trainer.parallel.tsp.norm import NormedRows, add_weight_grad, linear_rows
from tsp_trainer.parallel.tsp.ring import ShardBroadcasts, unpack

RECOMPUTE_MODES = typing.get_args(TspRecompute)   # parallel.tsp_recompute (module docstring)


@dataclasses.dataclass(frozen=True, eq=False)
class AttentionSettings:
    """What the attention function takes besides tensors, fixed when the layer is built. Compared
    by identity: it is also the key of the layer's checkpoint slot (tsp/kept.py)."""

    comm: Comm
    head_dim: int
    head_buckets: int
    tiling: TokenTiling
    norm_eps: float = 1e-6           # Qwen3's q/k norms
    kv_repeat: int = 1               # consecutive owners sharing one K/V head (ModelConfig.kv_repeat)
    chunk_tokens: int | str = "auto"  # parallel.attention_chunk_tokens (tsp/chunked.py)

    def kv_chunk(self, x: torch.Tensor, kv_heads: int) -> int | None:
        """Local tokens per K/V chunk for input x [B, T, h] and `kv_heads` KV heads an item, or
        None: the item gathers its whole K/V at once (the chunk covers every local token)."""
        if self.kv_repeat > 1:
            return None                  # K/V head copies gather once per sharing group, whole
        b, t = x.shape[:2]
        if self.chunk_tokens == "auto" and x.is_cuda and x.dtype not in (torch.bfloat16, torch.float16):
            return None                  # the chunks' flash kernel takes bf16/fp16 only (auto never refuses)
        per_token = b * self.comm.size * 2 * kv_heads * self.head_dim * x.element_size()
        chunk = resolve_attention_chunk_tokens(self.chunk_tokens, t, per_token)
        return chunk if chunk < t else None


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
                 replay_keeps: bool = True, replicated: ReplicatedGrads | None = None,
                 head_norms: tuple[torch.Tensor, torch.Tensor] | None = None, norm_eps: float = 1e-6,
                 kv_replicated: ReplicatedGrads | None = None,
                 attention_chunk_tokens: int | str = "auto"):
        super().__init__()
        # q_norm, k_norm weights [d] (Qwen3), replicated; absent otherwise (names as model.layers)
        if head_norms is not None:
            self.q_norm, self.k_norm = (_weight_holder(w) for w in head_norms)
        self.norm_eps = norm_eps
        self.replay_keeps = replay_keeps     # under checkpointing: the replay keeps the items
        self.tiling = tiling if tiling is not None else TokenTiling()
        bq, bk, bv = qkv_bias if qkv_bias is not None else (None, None, None)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            _weight_holder(w, b) for w, b in ((q, bq), (k, bk), (v, bv), (o, o_bias)))
        self.head_dim, self.comm, self.head_buckets = head_dim, comm, head_buckets
        self.replicated = _replicated(replicated, comm, self.o_proj.bias,
                                      *(m.weight for m in (getattr(self, "q_norm", None),
                                                           getattr(self, "k_norm", None)) if m is not None))
        n_kv_local = k.shape[0] // head_dim
        if n_kv_local % head_buckets:
            raise ValueError(f"parallel.head_buckets={head_buckets} must divide the KV heads per "
                             f"rank ({n_kv_local})")
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(f"parallel.tsp_recompute={recompute!r} is not one of {RECOMPUTE_MODES}")
        self.recompute = recompute
        # K/V head copies (fewer K/V heads than D): their gradients summed over the sharing ranks
        self.kv_replicated = kv_replicated
        kv_repeat = 1 if kv_replicated is None else kv_replicated.comm.size
        for m in (self.k_proj, self.v_proj) if kv_repeat > 1 else ():
            for p in (m.weight, m.bias):
                if p is not None:
                    kv_replicated.add(p)
        resolve_attention_chunk_tokens(attention_chunk_tokens, 1, 1)      # a bad value: here, not in forward
        self.settings = AttentionSettings(comm, head_dim, head_buckets, self.tiling, norm_eps, kv_repeat,
                                          attention_chunk_tokens)
        # the block's input norm handing its work over (tsp/norm.py NormHandoff; set by apply_tsp)
        self.norm_handoff = None

    def forward(self, x: torch.Tensor, rope: Rotary) -> torch.Tensor:
        # The shard's parameters, in packing order: W_q, W_k, W_v, W_o [, b_q, b_k, b_v]
        kv = self.kv_replicated.use if self.kv_replicated is not None else (lambda p: p)
        shard = [self.q_proj.weight, kv(self.k_proj.weight), kv(self.v_proj.weight), self.o_proj.weight]
        if self.q_proj.bias is not None:
            shard += [self.q_proj.bias, kv(self.k_proj.bias), kv(self.v_proj.bias)]
        # the items are kept under selective and none, and by a checkpoint replay that keeps them
        kept = kept_for_backward(self.recompute != "full", self.replay_keeps)
        norms = (None, None)
        if hasattr(self, "q_norm"):      # each rank's gradient is its tokens' part: summed over the group
            norms = tuple(self.replicated.use(m.weight) for m in (self.q_norm, self.k_norm))
        # x is the input norm's output, or its input when the norm handed its work over
        block_norm = self.norm_handoff.take() if self.norm_handoff is not None else None
        norm_w, norm_eps = block_norm if block_norm is not None else (None, None)
        y = _TSPAttentionFn.apply(x, rope, self.settings, kept, norm_w, norm_eps, *norms, *shard)
        if self.o_proj.bias is None:
            return y
        return y + self.replicated.use(self.o_proj.bias)


def _replicated(replicated: ReplicatedGrads | None, comm: Comm,
                *params: nn.Parameter | None) -> ReplicatedGrads | None:
    """Register the layer's replicated parameters (the o_proj bias, Qwen3's q/k norm weights) with
    the model's ReplicatedGrads (their gradients are summed over the group with the block norms');
    one without it would train on a partial gradient."""
    params = [p for p in params if p is not None]
    if not params:
        return replicated
    if replicated is None or replicated.comm is not comm:
        raise ValueError("a replicated parameter needs the model's ReplicatedGrads on the same group")
    for p in params:
        replicated.add(p)
    return replicated


def _weight_holder(w: torch.Tensor, b: torch.Tensor | None = None) -> nn.Module:
    """A submodule with `.weight` (and `.bias`, None when absent), so names match nn.Linear's."""
    m = nn.Module()
    m.weight = nn.Parameter(w)
    m.bias = None if b is None else (b if isinstance(b, nn.Parameter) else nn.Parameter(b))
    return m


class _Shard:
    """Views of one packed attention shard (W_q, W_k, W_v, W_o [, b_q, b_k, b_v]) or of its packed
    gradient: W_q, W_k, W_v are consecutive rows (and b_q, b_k, b_v consecutive), so [W_q; W_k;
    W_v] [(hq + 2 hkv)/D * d, h] and [b_q; b_k; b_v] are free views, split into head buckets by
    column ranges of the owner's projection (`_Columns`)."""

    def __init__(self, flat: torch.Tensor, shapes):
        q, k = shapes[0], shapes[1]
        rows = q[0] + 2 * k[0]
        fused = [(rows, q[1]), shapes[3]] + ([(rows,)] if len(shapes) > 4 else [])
        parts = unpack(flat, fused)
        self.wqkv, self.wo = parts[0], parts[1]
        self.bqkv = parts[2] if len(parts) > 2 else None


class _Columns:
    """Where bucket b's heads sit in an owner's projection [n, (hq + 2 hkv)/D * d] (the rows of
    [W_q; W_k; W_v]): q columns, then k, then v, each split into `buckets` equal runs."""

    def __init__(self, shapes, buckets: int):
        self.q, self.kv, self.buckets = shapes[0][0], shapes[1][0], buckets

    def q_cols(self, b: int) -> slice:
        w = self.q // self.buckets
        return slice(b * w, (b + 1) * w)

    def k_cols(self, b: int) -> slice:
        w = self.kv // self.buckets
        return slice(self.q + b * w, self.q + (b + 1) * w)

    def v_cols(self, b: int) -> slice:
        w = self.kv // self.buckets
        return slice(self.q + self.kv + b * w, self.q + self.kv + (b + 1) * w)


class _HeadNorms:
    """The per-head q/k RMSNorm weights [d] (Qwen3) and the fp32 [d] accumulators of this rank's
    part of their gradients (filled by the owners' backward, summed over the group by the caller)."""

    def __init__(self, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float):
        self.q, self.k, self.eps = q_weight, k_weight, eps
        self.dq = self.dk = None

    def backward(self, which: str, raw: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """The gradient [B, T, heads, d] at the norm's output -> at its input `raw` (the projection's
        heads); the weight's part is added into dq / dk."""
        dx, dw = rms_norm_grads(raw, getattr(self, which), self.eps, grad)
        acc = "d" + which
        setattr(self, acc, dw if getattr(self, acc) is None else getattr(self, acc).add_(dw))
        return dx

    def weight_grads(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return tuple(None if g is None else g.to(w.dtype) for g, w in ((self.dq, self.q), (self.dk, self.k)))


class _OwnerProjection:
    """This rank's local tokens through owner r's whole shard in one GEMM, x [Wq; Wk; Wv]^T (+ b)
    -> [B, T, (hq + 2 hkv)/D * d] (`rows`: x as [n, h], or the block norm's output of it made per
    token chunk, one GEMM a chunk: tsp/norm.py NormedRows), then the per-head q/k norms (Qwen3) and RoPE on its q and k
    heads; each bucket's item takes its heads' slices."""

    def __init__(self, x: torch.Tensor, rows: torch.Tensor | NormedRows, shard: _Shard, cols: _Columns,
                 rope: Rotary, d: int, norms: _HeadNorms | None = None):
        b, t, _ = x.shape
        p = linear_rows(rows, shard.wqkv, shard.bqkv).view(b, t, -1)      # [B, T, C]
        q, k = p[..., :cols.q].view(b, t, -1, d), p[..., cols.q:cols.q + cols.kv].view(b, t, -1, d)
        self.q_raw = self.k_raw = None
        if norms is not None:        # the norms' inputs, copied out of p (their backward needs them)
            self.q_raw, self.k_raw = q.clone(), k.clone()
            q, k = rms_norm(self.q_raw, norms.q, norms.eps), rms_norm(self.k_raw, norms.k, norms.eps)
        self.q = apply_rope(q, rope.cos, rope.sin)
        k = apply_rope(k, rope.cos, rope.sin)
        v = p[..., cols.q + cols.kv:].view(b, t, -1, d)
        self.hq, self.hkv = self.q.shape[2] // cols.buckets, k.shape[2] // cols.buckets
        hkv = self.hkv
        # each bucket's k, v stacked [B, T, 2, hkv_b, d] now, so the projection is freed here
        self.kv = [torch.stack((k[:, :, i * hkv:(i + 1) * hkv], v[:, :, i * hkv:(i + 1) * hkv]), dim=2)
                   for i in range(cols.buckets)]

    def item(self, b: int, comm: Comm, share: "_KVShare", owner: int,
             chunk: int | None = None) -> "_Item | ChunkedItem":
        """Bucket b's q [B, T, hq_b, d] (a view) and stacked k, v, its K/V all-gather issued (or
        shared with the previous owner's, `share`; or, with `chunk` local tokens, its first chunk:
        chunks are used only without K/V head copies)."""
        kv, self.kv[b] = self.kv[b], None
        q = self.q[:, :, b * self.hq:(b + 1) * self.hq]
        item = _Item(q, kv, comm, share, owner) if chunk is None else ChunkedItem(q, kv, comm, chunk)
        if self.q_raw is not None:
            item.q_raw = self.q_raw[:, :, b * self.hq:(b + 1) * self.hq]
            item.k_raw = self.k_raw[:, :, b * self.hkv:(b + 1) * self.hkv]
        return item


def _schedule(degree: int, buckets: int) -> list[tuple[int, int]]:
    """The items (owner r, head bucket b), in the order every rank runs them."""
    return [(r, b) for r in range(degree) for b in range(buckets)]


class _KVGather:
    """One item's K/V all-gather in flight. kv: this rank's [B, T, 2, H, d] (K and V stacked, after
    RoPE); wait() -> the logical-order [B, S, 2, H, d] of the whole group (the same tensor again
    to each owner sharing it, _KVShare)."""

    def __init__(self, kv: torch.Tensor, comm: Comm):
        self.kv, self.comm = kv, comm                  # kv stays referenced until the gather is done
        self.out = kv.new_empty((comm.size * kv.shape[0],) + kv.shape[1:])
        self.work = comm.all_gather(self.out, kv, tag="attn.kv", async_op=True)
        self.full: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.full = zigzag.gathered_to_logical(self.out.view((self.comm.size,) + self.kv.shape))
            self.out = self.work = self.kv = None
        return self.full


class _KVShare:
    """The K/V all-gathers of one pass when `repeat` consecutive owners share each K/V head (K/V
    heads fewer than D; their copies are equal, so is their K/V): the first owner of each group
    gathers, the others reuse its gather (one per group, not one per owner). repeat 1: one gather
    per item. The shared gather stays referenced until the next group's (or `release`)."""

    def __init__(self, repeat: int):
        self.repeat, self._gather = repeat, None

    def gather(self, owner: int, kv: torch.Tensor, comm: Comm) -> _KVGather:
        if self.repeat == 1:
            return _KVGather(kv, comm)
        if owner % self.repeat == 0:
            self._gather = _KVGather(kv, comm)
        return self._gather

    def release(self) -> None:
        self._gather = None


class _DKVSum:
    """The dK/dV reduce-scatters of one backward when `repeat` consecutive owners share each K/V
    head: the group's owners' dK/dV [B, S, H, d] are summed and reduce-scattered once, at its last
    owner, whose key/value side takes them; the others' take zeros (their copies' gradients come
    from the sum over the sharing ranks, ReplicatedGrads)."""

    def __init__(self, repeat: int):
        self.repeat, self._held = repeat, None

    def scatter(self, owner: int, dk: torch.Tensor, dv: torch.Tensor, comm: Comm):
        if self.repeat == 1:
            return _DKVScatter(dk, dv, comm)
        if self._held is not None:
            dk, dv = self._held[0] + dk, self._held[1] + dv
        if (owner + 1) % self.repeat:
            self._held = (dk, dv)
            return _NoDKV(dk, comm.size)
        self._held = None
        return _DKVScatter(dk, dv, comm)


class _NoDKV:
    """An owner whose K/V head's dK/dV go to the group's last owner: zeros [B, T, H, d] each."""

    def __init__(self, like: torch.Tensor, degree: int):
        b, s, heads, d = like.shape
        self.shape, self.like = (b, s // degree, heads, d), like.new_empty(())

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        zeros = self.like.new_zeros(self.shape)
        return zeros, zeros


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

    def __init__(self, q: torch.Tensor, kv: torch.Tensor, comm: Comm, share: _KVShare, owner: int):
        self.q, self.kv, self.comm, self.share, self.owner = q, kv, comm, share, owner
        self.q_raw = self.k_raw = None       # the q/k norms' inputs [B, T, heads_b, d] (Qwen3)
        self.gather: _KVGather | None = share.gather(owner, kv, comm)
        self.a = self.q_leaf = self.anchor = self.sink = self.dropped = None

    def regather(self) -> None:
        """Issue the K/V all-gather again (selective recompute's backward)."""
        self.gather = self.share.gather(self.owner, self.kv, self.comm)

    def attend(self, rope: Rotary, *, graph: bool, drop_kv: bool = False) -> torch.Tensor:
        """Wait for the gathered K/V and compute a = attention(q, K, V); with graph=True record the
        autograd graph from q and the K/V entry (drop_kv: without keeping the gathered K/V)."""
        full = self.gather.wait()
        self.gather = None
        if not graph:
            return attention_core(self.q, full[:, :, 0], full[:, :, 1], rope.runs, documents=rope.documents,
                                  kernel=rope.attention_kernel, gqa_path=rope.attention_gqa)
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
                self.a = attention_core(self.q_leaf, k, v, rope.runs, documents=rope.documents,
                                        kernel=rope.attention_kernel, gqa_path=rope.attention_gqa)
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


class _Projections:
    """The items' local projections, prepared in schedule order: owner r's one GEMM runs when
    the item of its first bucket is prepared (waiting for shard r's broadcast if needed), the
    items of its other buckets slice it."""

    def __init__(self, x: torch.Tensor, rows: torch.Tensor | NormedRows, shards: ShardBroadcasts,
                 settings: AttentionSettings, shapes, rope: Rotary, norms: _HeadNorms | None = None):
        self.x, self.shards, self.settings, self.shapes, self.rope = x, shards, settings, shapes, rope
        self.rows = rows
        self.norms = norms
        self.cols = _Columns(shapes, settings.head_buckets)
        self.share = _KVShare(settings.kv_repeat)
        self._owner: int | None = None
        self._projection: _OwnerProjection | None = None
        self.chunk = settings.kv_chunk(x, shapes[1][0] // settings.head_dim // settings.head_buckets)

    def item(self, r: int, b: int) -> _Item:
        """Item (r, b), its K/V all-gather issued."""
        if self._owner != r:
            shard = _Shard(self.shards.get(r), self.shapes)
            self._projection = _OwnerProjection(self.x, self.rows, shard, self.cols, self.rope,
                                                self.settings.head_dim, self.norms)
            self._owner = r
        item = self._projection.item(b, self.settings.comm, self.share, r, self.chunk)
        if b == self.settings.head_buckets - 1:           # the owner's last slices are taken
            self._owner = self._projection = None
        return item


class _OwnerOutputs:
    """One owner's attention outputs side by side, [n, hq/D * d] in bucket order (W_o's
    columns), for its one o_proj GEMM (forward) or dW_o GEMM (backward). One bucket: its output
    itself; more: each copied into one buffer as it comes (an extra [n, hq/D * d] per owner)."""

    def __init__(self, buckets: int):
        self.buckets, self._out = buckets, None

    def add(self, b: int, a: torch.Tensor) -> None:
        """Bucket b's output a [B, T, hq_b * d]."""
        a2 = a.reshape(-1, a.shape[-1])
        if self.buckets == 1:
            self._out = a2
            return
        if self._out is None:
            self._out = a2.new_empty((a2.shape[0], a2.shape[1] * self.buckets))
        w = a2.shape[1]
        self._out[:, b * w:(b + 1) * w] = a2

    def take(self) -> torch.Tensor:
        out, self._out = self._out, None
        return out


class _TSPAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rope: Rotary, settings: AttentionSettings, keep: Kept, norm_w, norm_eps, q_norm,
                k_norm, *params):
        # params: W_q, W_k, W_v, W_o [, b_q, b_k, b_v] of this rank's heads (one packed shard);
        # q_norm, k_norm: the per-head norm weights [d] (Qwen3) or None; norm_w [h], norm_eps: the
        # block's input norm when it handed its work over (x is then its input), else None
        comm, shapes = settings.comm, [tuple(w.shape) for w in params]
        norms = None if q_norm is None else _HeadNorms(q_norm, k_norm, settings.norm_eps)
        items, last = _schedule(comm.size, settings.head_buckets), settings.head_buckets - 1
        selective = keep.items               # record each item's attention graph for backward
        shards = ShardBroadcasts(comm, list(params), buffers=3, tag="attn.weights")
        rows, rstd = _block_norm_rows(x, norm_w, norm_eps, settings, keep.first_forward)
        projections = _Projections(x, rows, shards, settings, shapes, rope, norms)
        # the sum over owners: fp32, or x's dtype once the layer's tokens are tiled
        y = torch.zeros(x.shape, dtype=settings.tiling.accumulator_dtype(x), device=x.device)
        y2, outputs = y.view(-1, x.shape[-1]), _OwnerOutputs(settings.head_buckets)
        kept, nxt = [], projections.item(*items[0])
        for i, (r, b) in enumerate(items):
            item = nxt                       # the next item's gather in flight under this attention
            nxt = projections.item(*items[i + 1]) if i + 1 < len(items) else None
            outputs.add(b, item.attend(rope, graph=selective, drop_kv=selective).detach())
            if selective:
                kept.append(item)
            if b == last:                    # o_proj: one GEMM over the owner's buckets
                add_matmul(y2, outputs.take(), _Shard(shards.get(r), shapes).wo.t())
                shards.release(r)
        projections.share.release()          # kept items regather from the first owner of a group
        del rows, projections
        ctx.save_for_backward(x, norm_w, rstd, q_norm, k_norm, *params)
        ctx.rope, ctx.settings, ctx.shapes, ctx.norm_eps = rope, settings, shapes, norm_eps
        keep.store(ctx, settings, kept if selective else None)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, norm_w, rstd, q_norm, k_norm, *params = ctx.saved_tensors
        settings, comm, shapes, rope = ctx.settings, ctx.settings.comm, ctx.shapes, ctx.rope
        norms = None if q_norm is None else _HeadNorms(q_norm, k_norm, settings.norm_eps)
        items, kept = _schedule(comm.size, settings.head_buckets), Kept.load(ctx, settings)
        shards = ShardBroadcasts(comm, params, buffers=2, tag="attn.weights")
        grads = _GradReduces(comm, sum(p.numel() for p in params), x.device)
        dy2 = dy.reshape(-1, dy.shape[-1])                                      # [n, h]
        # x [n, h], or the block norm's output of it, made per token chunk where it is read
        x2 = (x.reshape(-1, x.shape[-1]) if norm_w is None
              else NormedRows(x.reshape(-1, x.shape[-1]), norm_w, ctx.norm_eps, rstd, _norm_chunks(x, settings)))
        # dX (at the block norm's output until the end, when the norm hands its work over)
        dx = torch.zeros(x2.shape, dtype=settings.tiling.accumulator_dtype(x), device=x.device)
        projections = _Projections(x, x2, shards, settings, shapes, rope, norms) if kept is None else None
        cols = _Columns(shapes, settings.head_buckets)
        dkv_sum = _DKVSum(settings.kv_repeat)

        def prepare(i: int) -> _Item:           # item i's activations, its K/V gather in flight
            if kept is not None:
                kept[i].regather()
                return kept[i]
            return projections.item(*items[i])

        def finish(pending: _PendingKV | None) -> None:   # an item's key/value side, then its owner's
            if pending is None:
                return
            if pending.finish(rope):                      # the owner's last bucket: its GEMMs ran
                shards.release(pending.owner)
                grads.reduce(pending.owner)

        item, pending, owner = prepare(0), None, None
        for i, (r, b) in enumerate(items):
            if kept is None:
                item.attend(rope, graph=True)    # full recompute: the attention forward again,
            if pending is not None and pending.owner != r:   # under which item i-1's dK/dV were
                finish(pending)                               # reduce-scattered
                pending = None
            nxt = prepare(i + 1) if i + 1 < len(items) else None    # its K/V gather in flight
            if b == 0:
                owner = _OwnerBackward(r, dy2, _Shard(shards.get(r), shapes),
                                       _Shard(grads.buffer(r), shapes), cols, settings.head_buckets, norms,
                                       dkv_sum)
            # same owner: item i-1's key/value side finishes after this item's attention backward
            pending, item = owner.query_side(x2, dy2, item, b, rope, comm, dx, pending), nxt
        finish(pending)
        own_grad = grads.finish()
        out = (g.to(p.dtype) for g, p in zip(unpack(own_grad, shapes), params))   # fp32 -> params'
        norm_grads = (None, None) if norms is None else norms.weight_grads()
        dx = dx.view(x.shape).to(x.dtype)
        # the block norm's backward, in place: dX at its output -> at its input, and its weight's part
        norm_w_grad = None if norm_w is None else x2.backward_in_place(dx.view(x2.shape))
        return (dx, None, None, None, norm_w_grad, None, *norm_grads, *out)


def _block_norm_rows(x: torch.Tensor, norm_w: torch.Tensor | None, eps: float | None,
                     settings: AttentionSettings, whole: bool) -> tuple[torch.Tensor | NormedRows,
                                                                        torch.Tensor | None]:
    """(what the owners' projections read, rstd [n, 1] to keep): x as [n, h] when it is the block
    norm's output; with the norm handed over (norm_w), its output of x made per token chunk
    (tsp/norm.py NormedRows, `_norm_chunks`), or at once when `whole` (a checkpointed block's
    first forward, which keeps nothing: one norm pass, as the norm itself would run), and rstd."""
    x2 = x.reshape(-1, x.shape[-1])
    if norm_w is None:
        return x2, None
    rows = NormedRows.of(x2, norm_w, eps, _norm_chunks(x, settings))
    return (rows.whole() if whole else rows), rows.rstd


def _norm_chunks(x: torch.Tensor, settings: AttentionSettings) -> list[slice]:
    """The token chunks in which the owners' projections and dW_qkv read the block norm's output:
    the layer's tiling, at most the norm's own chunk (model/rms_norm.py chunk_rows: 2,048 tokens
    at h 4,096, GEMMs of [2,048, h] x [h, (hq + 2 hkv)/D * d]), so the remade rows stay a few
    dozen MiB beside the attention's own transients."""
    n, h = x.numel() // x.shape[-1], x.shape[-1]
    return token_chunks(n, min(settings.tiling.chunk(n, x.element_size()), chunk_rows(h)))


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


class _OwnerBackward:
    """Owner r's backward over its head buckets, three GEMMs besides dW_o's: dA = dy W_o
    [n, hq/D * d] once, sliced per bucket; dW_o += dy^T A over the buckets' outputs A (one GEMM,
    after the last bucket's dK/dV reduce-scatter is issued, so it runs under it); and once the last
    bucket's dK/dV are in, dP = [dq | dk | dv] of all buckets [n, (hq + 2 hkv)/D * d] (after RoPE's
    adjoint, laid out as [W_q; W_k; W_v]'s rows) gives dW_qkv += dP^T x into the packed fp32
    gradient's contiguous [W_q; W_k; W_v] view, the q/k/v bias gradients (column sums) and
    dX += dP [W_q; W_k; W_v]. One dP per owner is in flight."""

    def __init__(self, owner: int, dy2: torch.Tensor, weights: _Shard, grads: _Shard,
                 cols: _Columns, buckets: int, norms: _HeadNorms | None = None,
                 dkv_sum: _DKVSum | None = None):
        self.owner, self.weights, self.grads, self.cols = owner, weights, grads, cols
        self.norms = norms
        self.dkv_sum = dkv_sum if dkv_sum is not None else _DKVSum(1)
        self.last = buckets - 1
        self.da = dy2 @ weights.wo                                       # [n, hq/D * d]
        self.dp: torch.Tensor | None = None     # [n, (hq + 2 hkv)/D * d], from the first dq on
        self.outputs = _OwnerOutputs(buckets)

    def query_side(self, x2, dy2, item: _Item, b: int, rope: Rotary, comm: Comm, dx: torch.Tensor,
                   previous: "_PendingKV | None") -> "_PendingKV":
        """Backpropagate dy through bucket b's recorded attention up to its dK/dV, whose
        reduce-scatter is issued; dq (after RoPE's adjoint) goes into dP. x2, dy2, dx [n, h].
        `previous`: this owner's previous bucket, whose scatter ran under this attention backward;
        its key/value side is finished before this bucket's scatter is issued (one in flight)."""
        a, cols = item.a, self.cols
        self.outputs.add(b, a.detach())
        dq, dkv = item.backward(self.da[:, cols.q_cols(b)].view(a.shape))
        if previous is not None:
            previous.finish(rope)
        # dK/dV summed meanwhile (a chunked item has issued its chunks' scatters already)
        scatter = (item.scatter(dkv) if isinstance(item, ChunkedItem)
                   else self.dkv_sum.scatter(self.owner, *dkv, comm))
        del dkv
        if b == self.last:
            self.da = None
        dq = apply_rope_backward(dq, rope.cos, rope.sin)
        if self.norms is not None:
            dq = self.norms.backward("q", item.q_raw, dq)
        self._put(cols.q_cols(b), dq)
        if b == self.last:                                                # dW_o, under the scatter
            add_matmul(self.grads.wo, dy2.t(), self.outputs.take())
        return _PendingKV(scatter, self, b, x2, dx, item.k_raw)

    def key_value_side(self, b: int, dk: torch.Tensor, dv: torch.Tensor, rope: Rotary,
                       x2: torch.Tensor, dx: torch.Tensor, k_raw: torch.Tensor | None = None) -> bool:
        """Bucket b's dK, dV [B, T, hkv_b, d] (this rank's tokens, summed over the group) into dP;
        after the last bucket the owner's dW_qkv, bias and dX GEMMs run. True then. k_raw: the k
        norm's input of this bucket's local tokens (Qwen3)."""
        dk = apply_rope_backward(dk, rope.cos, rope.sin)
        if self.norms is not None:
            dk = self.norms.backward("k", k_raw, dk)
        self._put(self.cols.k_cols(b), dk)
        self._put(self.cols.v_cols(b), dv)
        if b != self.last:
            return False
        add_weight_grad(self.grads.wqkv, self.dp, x2)                    # [dW_q; dW_k; dW_v]
        if self.grads.bqkv is not None:
            self.grads.bqkv.add_(self.dp.sum(0, dtype=torch.float32))
        add_matmul(dx, self.dp, self.weights.wqkv)                       # dX from q, k and v
        self.dp = None
        return True

    def _put(self, cols: slice, grad: torch.Tensor) -> None:
        """grad [B, T, heads, d] into dP's columns `cols`."""
        if self.dp is None:              # after bucket 0's attention backward: not alive under it
            n = grad.shape[0] * grad.shape[1]
            self.dp = grad.new_empty((n, self.weights.wqkv.shape[0]))
        self.dp[:, cols].view(grad.shape).copy_(grad)


class _PendingKV:
    """An item whose dK/dV reduce-scatter is in flight: its key/value side runs once the scatter
    is waited for (`finish`, True when that completed its owner's backward)."""

    def __init__(self, scatter: _DKVScatter, owner: _OwnerBackward, bucket: int, x2, dx, k_raw=None):
        self.scatter, self.state, self.bucket, self.owner = scatter, owner, bucket, owner.owner
        self.x2, self.dx, self.k_raw = x2, dx, k_raw

    def finish(self, rope: Rotary) -> bool:
        dk, dv = self.scatter.wait()
        return self.state.key_value_side(self.bucket, dk, dv, rope, self.x2, self.dx, self.k_raw)
