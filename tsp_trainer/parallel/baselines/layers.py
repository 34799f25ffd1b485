"""Baseline blocks: one set of modules covers TP, TP+SP, SP and TP x SP, configured by `Groups`.

A baseline on rank p is two sub-axes of the model-parallel group: tp (size T) splits the weights
Megatron-style (column parallel q, k, v, gate, up; row parallel o, down; vocabulary rows), and sp
(size S) splits the tokens zigzag with the weights replicated and K/V all-gathered. TP = (T=D,
S=1), TP+SP = TP with `sequence_parallel`, SP = (T=1, S=D), TP x SP = (T, S). What each block
holds and moves: docs/parallelism.md, "The baselines, on the same code".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from tsp_trainer.model.layers import RMSNorm, Rotary, apply_rope, gated_mlp
from tsp_trainer.model.rms_norm import rms_norm
from tsp_trainer.model.transformer import IGNORE_INDEX, TokenStats
from tsp_trainer.parallel.baselines.context import context_attention
from tsp_trainer.parallel.baselines.megatron import (copy_to_region, copy_weight_to_region,
                                                     gather_from_sequence,
                                                     reduce_from_region, reduce_scatter_to_sequence,
                                                     tiled_vocab_parallel_loss,
                                                     vocab_parallel_argmax,
                                                     vocab_parallel_cross_entropy,
                                                     vocab_parallel_lookup)
from tsp_trainer.parallel.comm import Comm
from tsp_trainer.parallel.gated_mlp import (TokenTiling, gated_mlp_backward_into, gated_mlp_forward_into,
                                            split_gate_up)
from tsp_trainer.parallel.loss_chunks import mask_vocab_padding, resolve_loss_chunk_tokens, token_chunks


@dataclass(frozen=True)
class Groups:
    """The sub-axes a baseline block works on, seen from this rank."""

    tp: Comm                    # weights column/row split (size 1: none)
    sp: Comm                    # tokens zigzag split, K/V all-gathered, weights replicated (size 1: none)
    sequence_parallel: bool     # Megatron SP: outside the TP region tokens are split over tp
    norm_grad: Comm | None      # replicated norm weights: grads summed over this group (None: no sum)
    # the per-head q/k norm weights (Qwen3): each rank sees other heads (tp) and other tokens (sp)
    # of them, so their grads are summed over the whole model-parallel group (None: D = 1)
    head_norm_grad: Comm | None = None
    # attention over the sp sub-axis: (q, k, v, q_runs, sp, documents, kernel, gqa_path) -> [B, T, Hq * d]; the
    # K/V all-gather of context parallelism, or Ulysses' all-to-alls (parallel/ulysses.py)
    attend: Callable = context_attention
    # False when DeepSpeed ZeRO-3 shards the weights over every rank of the sp sub-axis and dp
    # (parallel/sharded_weights.py): it reduce-scatters each weight's gradient over that whole set,
    # so a sum over sp here as well would count every token's contribution twice
    sums_weight_grads: bool = True
    # K/V heads fewer than T: the tp ranks holding copies of this rank's K/V head, over which the
    # copies' gradients are summed (mesh.build_kv_comm; None: no copies)
    kv_grad: Comm | None = None

    def enter_tp(self, x: torch.Tensor, tag: str) -> torch.Tensor:
        """Before the column-parallel matmuls: every tp rank needs all tokens of the region."""
        if self.sequence_parallel:
            return gather_from_sequence(x, self.tp, tag)
        return copy_to_region(x, self.tp, tag)

    def leave_tp(self, y: torch.Tensor, tag: str) -> torch.Tensor:
        """After the row-parallel matmul: sum the partial outputs over tp."""
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(y, self.tp, tag)
        return reduce_from_region(y, self.tp, tag)

    def weight(self, w: torch.Tensor | None) -> torch.Tensor | None:
        """A weight replicated over sp: its gradient is summed over sp (fp32) inside autograd, unless
        ZeRO-3 reduces it (sums_weight_grads False)."""
        if w is None or not self.sums_weight_grads:
            return w
        return copy_weight_to_region(w, self.sp, "wgrad")

    def kv_weight(self, w: torch.Tensor | None) -> torch.Tensor | None:
        """A K/V projection weight or bias: replicated over sp like every weight, and a copy over
        kv_grad when K/V heads are fewer than T (each copy's gradient covers its tp rank's query
        heads only: summed in fp32 over the copies, as Megatron reduces replicated K/V heads)."""
        w = self.weight(w)
        return w if w is None or self.kv_grad is None else copy_weight_to_region(w, self.kv_grad, "kv.grad")

    def add_replicated_bias(self, y: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """y + b for a bias added once per token after leaving the TP region (o_proj, down_proj):
        replicated like a norm weight, its gradient summed (fp32) over the same token-splitting
        groups."""
        if b is None:
            return y
        return y + (b if self.norm_grad is None else copy_weight_to_region(b, self.norm_grad, "bias.grad"))


def _holder(w: torch.Tensor, b: torch.Tensor | None = None) -> nn.Module:
    """A submodule with `.weight` (and `.bias`, None when absent), so names match model.layers
    (q_proj.weight, q_proj.bias, ...)."""
    m = nn.Module()
    m.weight = w if isinstance(w, nn.Parameter) else nn.Parameter(w)
    m.bias = None if b is None else (b if isinstance(b, nn.Parameter) else nn.Parameter(b))
    return m


class ParallelAttention(nn.Module):
    """q/k/v_proj.weight [n_h/T * d | n_kv/T * d, h] (column parallel), o_proj.weight
    [h, n_h/T * d] (row parallel): the heads of group tp_rank, whole for T = 1. Biases: q/k/v
    [n_h/T * d | n_kv/T * d] with their heads, o_proj.bias [h] replicated. K/V heads fewer than T:
    k/v_proj hold a copy of the one K/V head [d, h] this rank's query heads use (Groups.kv_grad)."""

    def __init__(self, q, k, v, o, *, head_dim: int, groups: Groups, qkv_bias=None, o_bias=None,
                 head_norms=None, norm_eps: float = 1e-6):
        super().__init__()
        bq, bk, bv = qkv_bias if qkv_bias is not None else (None, None, None)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            _holder(w, b) for w, b in ((q, bq), (k, bk), (v, bv), (o, o_bias)))
        self.head_dim, self.groups = head_dim, groups
        if head_norms is not None:   # Qwen3's q_norm, k_norm [d], replicated
            self.q_norm, self.k_norm = (_holder(w) for w in head_norms)
            self.norm_eps = norm_eps

    def _head_norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """The per-head RMSNorm `name` (q_norm / k_norm) on x [B, T, heads, d]. Every rank of the
        group sees other heads (tp) or other tokens (sp) of it: its gradient is summed over the
        whole group (`head_norm_grad`)."""
        w, comm = getattr(self, name).weight, self.groups.head_norm_grad
        return rms_norm(x, w if comm is None else copy_weight_to_region(w, comm, "norm.grad"), self.norm_eps)

    def forward(self, x: torch.Tensor, rope: Rotary) -> torch.Tensor:
        g, d = self.groups, self.head_dim
        wq, wo = g.weight(self.q_proj.weight), g.weight(self.o_proj.weight)
        wk, wv = g.kv_weight(self.k_proj.weight), g.kv_weight(self.v_proj.weight)
        bq, bk, bv = g.weight(self.q_proj.bias), g.kv_weight(self.k_proj.bias), g.kv_weight(self.v_proj.bias)
        x = g.enter_tp(x, "attn.tp")                           # [B, T_region, h]
        b, t, _ = x.shape
        q, k = F.linear(x, wq, bq).view(b, t, -1, d), F.linear(x, wk, bk).view(b, t, -1, d)
        if hasattr(self, "q_norm"):                         # before RoPE (Qwen3)
            q, k = self._head_norm("q_norm", q), self._head_norm("k_norm", k)
        q = apply_rope(q, rope.cos, rope.sin)
        k = apply_rope(k, rope.cos, rope.sin)
        v = F.linear(x, wv, bv).view(b, t, -1, d)
        out = g.attend(q, k, v, rope.runs, g.sp, rope.documents, rope.attention_kernel,
                       rope.attention_gqa)                                # [B, T_region, n_h/T * d]
        return g.add_replicated_bias(g.leave_tp(F.linear(out, wo), "attn.tp"), self.o_proj.bias)


class ParallelMLP(nn.Module):
    """gate/up_proj.weight [I/T, h] (column parallel), down_proj.weight [h, I/T] (row parallel);
    gate/up_proj.bias [I/T] with their rows, down_proj.bias [h] replicated. `tiling`: the TP
    region's tokens in chunks (parallel.mlp_chunk_tokens, parallel/gated_mlp.py): the
    intermediates are [chunk, I/T], forward and backward, and the communication is unchanged."""

    def __init__(self, gate, up, down, *, groups: Groups, gate_up_bias=None, down_bias=None,
                 tiling: TokenTiling | None = None):
        super().__init__()
        bg, bu = gate_up_bias if gate_up_bias is not None else (None, None)
        self.gate_proj, self.up_proj, self.down_proj = (
            _holder(w, b) for w, b in ((gate, bg), (up, bu), (down, down_bias)))
        self.groups = groups
        self.tiling = tiling if tiling is not None else TokenTiling(inter_shard=gate.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.groups
        ws = [g.weight(m.weight) for m in (self.gate_proj, self.up_proj, self.down_proj)]
        bs = [g.weight(m.bias) for m in (self.gate_proj, self.up_proj)]
        x = g.enter_tp(x, "mlp.tp")                                # [B, T_region, h]
        chunks = self.tiling.chunks(x)
        if len(chunks) == 1:                  # one chunk: autograd keeps the intermediates
            part = gated_mlp(x, *ws, *bs)
        else:
            part = _TiledGatedMLP.apply(x, chunks, *ws, *(b for b in bs if b is not None))
        return g.add_replicated_bias(g.leave_tp(part, "mlp.tp"), self.down_proj.bias)


class _TiledGatedMLP(torch.autograd.Function):
    """This rank's block of the gated MLP (no down_proj bias) over its region's tokens, chunk by
    chunk: saved x and the weights only; backward recomputes each chunk's gate/up (two GEMMs of
    the forward again) and writes the weight gradients into fp32 accumulators. W_gate and W_up
    are separate parameters here, so gate and up are two GEMMs into one [chunk, 2 I/T] buffer
    (`split_gate_up`: stacking them would copy the weights each pass)."""

    @staticmethod
    def forward(ctx, x, chunks: list[slice], *params):
        # params: W_gate, W_up, W_down [, b_gate, b_up]
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        gated_mlp_forward_into(x.reshape(-1, x.shape[-1]), split_gate_up(list(params)),
                               y.view(-1, x.shape[-1]).zero_(), chunks)
        ctx.save_for_backward(x, *params)
        ctx.chunks = chunks
        return y

    @staticmethod
    def backward(ctx, dy):
        x, *params = ctx.saved_tensors
        h = x.shape[-1]
        acc = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in params]
        dx = torch.zeros((x.numel() // h, h), dtype=x.dtype, device=x.device)
        gated_mlp_backward_into(x.reshape(-1, h), dy.reshape(-1, h), split_gate_up(params),
                                split_gate_up(acc), dx, ctx.chunks)
        return (dx.view(x.shape), None, *(a.to(p.dtype) for a, p in zip(acc, params)))


class ParallelRMSNorm(RMSNorm):
    """Replicated RMSNorm; the weight gradient is summed over `comm` (the groups that split the
    tokens this norm sees), or left alone when every rank saw the same tokens (TP: comm=None)."""

    def __init__(self, norm: RMSNorm, *, comm: Comm | None):
        super().__init__(norm.weight.shape[0], norm.eps, device="meta")   # weight replaced below
        self.weight, self.comm = norm.weight, comm

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        w = self.weight if self.comm is None else copy_weight_to_region(self.weight, self.comm, "norm.grad")
        return super().forward(x, w)


class ParallelEmbedding(nn.Module):
    """Vocab-parallel embedding: weight [V/T, h] = rows vocab_start.. of the table."""

    def __init__(self, weight, *, vocab_start: int, groups: Groups):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight)
        self.vocab_start, self.groups = vocab_start, groups

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        g = self.groups
        part = vocab_parallel_lookup(ids, g.weight(self.weight), self.vocab_start)
        return g.leave_tp(part, "embed.tp")


class ParallelLMHead(nn.Module):
    """Vocab-parallel LM head: weight [V/T, h]; loss_sum uses the vocab-parallel cross-entropy,
    so no rank holds more than [tokens, V/T] logits, and with the tokens tiled
    (`loss_chunk_tokens`, `loss_budget_bytes`: parallel/loss_chunks.py) no more than [chunk, V/T]."""

    def __init__(self, weight, *, vocab_start: int, groups: Groups,
                 loss_chunk_tokens: int | str = "auto", loss_budget_bytes: int | None = None,
                 vocab_size: int | None = None):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight)
        self.vocab_start, self.groups = vocab_start, groups
        self.vocab_size = vocab_size           # rows at or past it are padding: -inf logits
        self.loss_chunk_tokens, self.loss_budget_bytes = loss_chunk_tokens, loss_budget_bytes

    def chunk_tokens(self, region_tokens: int) -> int:
        """Tokens per chunk of the loss for `region_tokens` tokens in the TP region."""
        return resolve_loss_chunk_tokens(self.loss_chunk_tokens, region_tokens, self.weight.shape[0],
                                         self.loss_budget_bytes)

    def loss_sum(self, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Through the module call, as token_stats: its hooks run (DeepSpeed ZeRO-3 gathers the
        weight for the call and again for its backward)."""
        return self(hidden, labels)

    @torch.no_grad()
    def token_stats(self, hidden: torch.Tensor, labels: torch.Tensor) -> TokenStats:
        return self(hidden, labels, stats=True)

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None, *, stats: bool = False):
        """hidden alone: full logits (_logits); with labels: (loss sum, valid count) (_loss_sum), or
        with stats=True the per-token TokenStats (_token_stats)."""
        if labels is None:
            return self._logits(hidden)
        return self._token_stats(hidden, labels) if stats else self._loss_sum(hidden, labels)

    def _loss_sum(self, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.groups
        x, w = g.enter_tp(hidden, "head.tp"), g.weight(self.weight)
        chunk = self.chunk_tokens(labels.numel())
        if chunk < labels.numel():
            losses = tiled_vocab_parallel_loss(x, w, labels, vocab_start=self.vocab_start,
                                               comm=g.tp, chunk=chunk, vocab_size=self.vocab_size)
        else:                                  # one chunk: the logits block, its softmax kept
            logits = mask_vocab_padding(F.linear(x, w), self.vocab_start, self.vocab_size)   # [B, T, V/T]
            losses = vocab_parallel_cross_entropy(logits, labels, vocab_start=self.vocab_start, comm=g.tp)
        valid = labels != IGNORE_INDEX
        return (losses * valid).sum(), valid.sum()

    @torch.no_grad()
    def _token_stats(self, hidden: torch.Tensor, labels: torch.Tensor) -> TokenStats:
        """Loss and argmax [B, T_region] of the region's tokens (those of this rank's layout:
        all tokens under TP and TP+SP, the zigzag slice under SP), with [chunk, V/T] logits only."""
        g = self.groups
        x = g.enter_tp(hidden, "head.tp")
        flat, flat_labels = x.reshape(-1, x.shape[-1]), labels.reshape(-1)
        losses = torch.empty(flat_labels.shape, dtype=torch.float32, device=x.device)
        best = torch.empty_like(flat_labels)
        for c in token_chunks(flat_labels.numel(), self.chunk_tokens(flat_labels.numel())):
            logits = mask_vocab_padding(F.linear(flat[c], self.weight), self.vocab_start,
                                        self.vocab_size)                       # [chunk, V/T]
            # argmax first: the cross-entropy works on the logits in place
            best[c] = vocab_parallel_argmax(logits, vocab_start=self.vocab_start, comm=g.tp)
            losses[c] = vocab_parallel_cross_entropy(logits, flat_labels[c],
                                                     vocab_start=self.vocab_start, comm=g.tp)
        losses = losses.view(labels.shape)
        return TokenStats(losses * (labels != IGNORE_INDEX), best.view(labels.shape))

    @torch.no_grad()
    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full logits [B, T_region, V] of the region's tokens (evaluation, parity tests)."""
        g = self.groups
        x = gather_from_sequence(hidden, g.tp, "head.tp") if g.sequence_parallel else hidden
        logits = F.linear(x, self.weight)
        if g.tp.size == 1:
            return logits
        parts = logits.new_empty((g.tp.size,) + tuple(logits.shape))
        g.tp.all_gather(parts.view((-1,) + tuple(logits.shape[1:])), logits.contiguous(), tag="head.logits")
        return torch.cat(list(parts.unbind(0)), dim=-1)[..., :self.vocab_size]   # padding cut off
