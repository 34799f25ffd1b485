"""Context-parallel causal attention for the SP and TP x SP baselines (all-gather flavour, as in
Llama 3's context parallelism): each rank holds the zigzag chunks p and 2S-1-p of every sequence
(parallel/zigzag.py) and the full weights of its heads.

| Step      | Forward op                                          | Backward op                          |
|-----------|-----------------------------------------------------|--------------------------------------|
| K/V       | all-gather local K, V over the sp group, reorder to | re-gather K, V (not kept between     |
|           | logical order, causal attention of local queries    | passes); dK, dV reduce-scattered     |
|           |                                                     | back to the token owners             |

The gathered K/V of all tokens is transient: only the local q, k, v are saved, and backward
re-gathers and recomputes the attention (the same choice TSP makes; section 5.2 of the TSP paper,
https://arxiv.org/abs/2604.26294, counts SP's gathered K/V as transient). Cost: one extra K/V
all-gather and one attention forward per layer.
"""

from __future__ import annotations

import torch

from tsp_trainer.model.documents import Documents
from tsp_trainer.model.layers import attention_core
from tsp_trainer.parallel import zigzag
from tsp_trainer.parallel.comm import Comm


def gather_kv(k: torch.Tensor, v: torch.Tensor, comm: Comm) -> tuple[torch.Tensor, torch.Tensor]:
    """Local K, V [B, T, H, d] -> K, V of all S tokens [B, S, H, d] in logical order."""
    kv = torch.stack((k, v), dim=2)                                       # [B, T, 2, H, d]
    out = kv.new_empty((comm.size * kv.shape[0],) + kv.shape[1:])
    comm.all_gather(out, kv, tag="attn.kv")
    full = zigzag.gathered_to_logical(out.view((comm.size,) + kv.shape))  # [B, S, 2, H, d]
    return full[:, :, 0], full[:, :, 1]


def scatter_dkv(dk: torch.Tensor, dv: torch.Tensor, comm: Comm) -> tuple[torch.Tensor, torch.Tensor]:
    """Transpose of gather_kv: sum dK, dV [B, S, H, d] over the group, keep the local tokens."""
    dkv = zigzag.pair_to_gathered(dk, dv, comm.size)                     # [S', B, T, 2, H, d]
    out = dkv.new_empty(dkv.shape[1:])
    comm.reduce_scatter(out, dkv.view((-1,) + dkv.shape[2:]), tag="attn.dkv")
    return out[:, :, 0], out[:, :, 1]


class _ContextAttention(torch.autograd.Function):
    """Forward: all-gather K, V over `comm`; causal attention of the local queries at their global
    positions. Backward: re-gather K, V, recompute, reduce-scatter dK, dV to the token owners."""

    @staticmethod
    def forward(ctx, q, k, v, q_runs, comm: Comm, documents, kernel: str, gqa_path: str):
        k_all, v_all = gather_kv(k, v, comm)
        out = attention_core(q, k_all, v_all, q_runs, documents=documents, kernel=kernel, gqa_path=gqa_path)
        ctx.save_for_backward(q, k, v)
        ctx.comm, ctx.q_runs, ctx.documents, ctx.kernel, ctx.gqa_path = comm, q_runs, documents, kernel, gqa_path
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors
        k_all, v_all = gather_kv(k, v, ctx.comm)
        with torch.enable_grad():
            ql, kl, vl = (t.detach().requires_grad_() for t in (q, k_all, v_all))
            out = attention_core(ql, kl, vl, ctx.q_runs, documents=ctx.documents, kernel=ctx.kernel,
                                 gqa_path=ctx.gqa_path)
            dq, dk_all, dv_all = torch.autograd.grad(out, (ql, kl, vl), dout)
        del out, kl, vl, k_all, v_all
        dk, dv = scatter_dkv(dk_all, dv_all, ctx.comm)
        return dq, dk, dv, None, None, None, None, None


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      q_runs: tuple[tuple[int, int, int], ...], comm: Comm,
                      documents: Documents | None = None, kernel: str = "fa2",
                      gqa_path: str = "native") -> torch.Tensor:
    """q [B, T, Hq, d], k, v [B, T, Hkv, d] of the local zigzag tokens, whose global positions
    are the runs `q_runs` (Rotary.runs) -> attention output [B, T, Hq * d]. A group of size 1
    holds the whole sequence in order. `documents`: the rows' document starts (masking);
    `kernel`, `gqa_path`: the run's attention kernel and GQA path (Rotary.attention_kernel,
    Rotary.attention_gqa)."""
    if comm.size == 1:
        return attention_core(q, k, v, q_runs if documents is not None else None, documents=documents,
                              kernel=kernel, gqa_path=gqa_path)
    return _ContextAttention.apply(q, k, v, q_runs, comm, documents, kernel, gqa_path)
