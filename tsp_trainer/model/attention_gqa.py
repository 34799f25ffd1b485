"""GQA-native attention of one call: K/V and dK/dV stay at the KV heads in forward and backward.

A fused kernel run with enable_gqa (FA2 through SDPA) writes dK, dV per query head in its backward,
[B, Hq, n_k, d] each, and sums them per KV head; a kernel without GQA (memory-efficient, cuDNN)
needs K/V repeated to the query heads first. Here the call is planned as the blocks of
model/attention_chunk.py with all keys as one chunk, and each block runs through its GQA-native
`block_forward` / `block_backward`: a causal block once per group member g (query heads g, G + g,
... against the Hkv heads), a full block (keys before every query) once with the G query heads of
each KV head stacked along the query axis. Every kernel call takes Hkv heads; the G calls of a
causal block do the FLOPs of one call with Hq heads, so the cost is kernel launches:

    square causal (queries are the keys):         G forward and G backward calls;
    a query run against its key prefix (zigzag):  1 + G each (the prefix full, the diagonal causal);
    document masking: per row and document piece, the same rule; on CUDA the route sends it to
    G varlen calls per row instead (model/attention_route.py: grouped_varlen_attention), whatever
    the number of documents.

Outputs of several blocks over the same queries are merged by log-sum-exp into fp32 accumulators
(MergedAttention, [B, Hq, Tq, d] and [B, Hq, Tq]); a call that is one causal block needs none.
Backward writes each block's dQ into an fp32 [B, Hq, Tq, d] buffer and its dK, dV into buffers
[B, Hkv, n_k, d] of the keys' dtype (a key gets at most G + 2 contributions: its causal block's G
members, which block_backward sums, and the two zigzag runs' full blocks). On CUDA the kernels
are flash attention's varlen calls (bf16 / fp16), on CPU torch's CPU flash kernel: the same code
on both, which the CPU suite checks against the fused path.
"""

from __future__ import annotations

import torch

from tsp_trainer.model.attention_chunk import (MergedAttention, Runs, block_backward, block_forward,
                                               chunk_backward, chunk_forward, row_plans)


def _one_causal_block(q_runs: Runs | None, tq: int, tk: int, documents) -> bool:
    """Whether the call is one square causal block: the queries are the keys, no documents."""
    return documents is None and (q_runs is None or tuple(q_runs) == ((0, tk, 0),)) and tq == tk


class GroupedQueryAttention(torch.autograd.Function):
    """q [B, Hq, Tq, d]; k, v [B, Hkv, Tk, d] in logical order (key j at position j) -> out
    [B, Hq, Tq, d]; q_runs: the queries' (start, stop, first position) runs (None: the queries
    are the keys); documents: model/documents.py's Documents or None."""

    @staticmethod
    def forward(ctx, q, k, v, q_runs, documents):
        tq, tk = q.shape[2], k.shape[2]
        single = _one_causal_block(q_runs, tq, tk, documents)
        if single:
            out, lse = block_forward(q, k, v, True)
        else:
            merged = MergedAttention(q)
            chunk_forward(merged, q, k, v, q_runs or ((0, tq, 0),), ((0, tk, 0),), documents)
            out, lse = merged.out.to(q.dtype), merged.lse
            del merged
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.q_runs, ctx.documents, ctx.single = q_runs, documents, single
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        if ctx.single:
            dq, dk, dv = block_backward(dout, q, k, v, out, lse, True)
            return dq, dk, dv, None, None
        tq, tk = q.shape[2], k.shape[2]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        chunk_backward(dout, q, k, v, out, lse, ctx.q_runs or ((0, tq, 0),), ((0, tk, 0),), dq, dk, dv,
                       ctx.documents)
        return dq.to(q.dtype), dk, dv, None, None


def grouped_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_runs: Runs | None = None,
                            documents=None) -> torch.Tensor:
    """Causal attention of q [B, Hq, Tq, d] against k, v [B, Hkv, Tk, d] (module docstring)."""
    return GroupedQueryAttention.apply(q, k, v, q_runs, documents)


def grouped_kernel_calls(q_runs: Runs | None, tq: int, tk: int, groups: int, documents=None) -> int:
    """Kernel calls of one forward (and as many of its backward): a causal block G, a full one 1."""
    if _one_causal_block(q_runs, tq, tk, documents):
        return groups
    return sum(groups if blk.causal else 1
               for _, blocks in row_plans(q_runs or ((0, tq, 0),), ((0, tk, 0),), documents, None)
               for blk in blocks)


__all__ = ["GroupedQueryAttention", "grouped_kernel_calls", "grouped_query_attention"]
