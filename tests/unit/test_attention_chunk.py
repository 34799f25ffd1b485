"""Attention of the queries in hand against the keys one chunk at a time (model/attention_chunk.py),
against `attention_core` on the whole keys, one process, fp32: output, dQ, dK, dV for zigzag-like
query runs, chunks that cut the runs anywhere, GQA and document masking. GQA's dK/dV come out of
every kernel call with the KV heads only. The auto chunk of TSP (parallel/loss_chunks.py) is the
unchunked path until an item's gathered K/V exceeds its bound."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.attention_block import attention_block_step
from tsp_trainer.model import attention_chunk
from tsp_trainer.model.attention_chunk import MergedAttention, chunk_backward, chunk_forward, plan_blocks
from tsp_trainer.model.documents import Documents
from tsp_trainer.model.layers import attention_core
from tsp_trainer.parallel.loss_chunks import (DEFAULT_KV_BLOCK_BYTES, auto_attention_chunk_tokens,
                                              resolve_attention_chunk_tokens)
from tsp_trainer.parallel.tsp.chunked import key_runs

B, S, D_HEAD = 2, 24, 8
Q_TOKENS = list(range(4, 10)) + list(range(16, 24))          # two runs, as a zigzag rank holds
Q_RUNS = ((0, 6, 4), (6, 14, 16))
TOL = dict(rtol=1e-5, atol=1e-6)


def _chunked(q, k, v, grad, chunk: int, documents):
    """Output [B, Tq, Hq d] and dq, dk, dv in attention_core's layouts, keys in chunks of `chunk`
    taken in reverse order (the merge must not depend on it), at most 3 queries a kernel call
    (causal squares cut into tiles)."""
    qt = q.transpose(1, 2)
    bounds = [(s, min(S, s + chunk)) for s in range(0, S, chunk)][::-1]
    merged = MergedAttention(qt)
    for s, e in bounds:
        chunk_forward(merged, qt, k[:, s:e].transpose(1, 2), v[:, s:e].transpose(1, 2), Q_RUNS,
                      ((0, e - s, s),), documents, tile=3)
    out = merged.out.to(q.dtype)
    dq = torch.zeros_like(merged.out)
    dk, dv = (torch.zeros(t.transpose(1, 2).shape) for t in (k, v))
    dout = grad.view(q.shape).transpose(1, 2)
    for s, e in bounds:
        chunk_backward(dout, qt, k[:, s:e].transpose(1, 2), v[:, s:e].transpose(1, 2), out, merged.lse,
                       Q_RUNS, ((0, e - s, s),), dq, dk[:, :, s:e], dv[:, :, s:e], documents, tile=3)
    return (out.transpose(1, 2).reshape(grad.shape), dq.transpose(1, 2), dk.transpose(1, 2),
            dv.transpose(1, 2))


@pytest.mark.parametrize("hq,hkv,documents", [
    (4, 2, None), (6, 2, Documents.from_lengths([[5, 11, 8], [1, 16, 7]])), (2, 2, None)],
    ids=["gqa", "gqa3_documents", "mha"])
def test_chunks_equal_whole_keys(hq, hkv, documents, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, S, hq, D_HEAD, generator=gen)[:, Q_TOKENS].requires_grad_()
    k, v = (torch.randn(B, S, hkv, D_HEAD, generator=gen).requires_grad_() for _ in range(2))
    ref = attention_core(q, k, v, Q_RUNS, documents=documents)
    grad = torch.randn(ref.shape, generator=gen)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    key_heads = []                                 # the heads of every dK the kernels return
    backward = attention_chunk._kernel_backward

    def recording(*args):
        dq, dk, dv = backward(*args)
        key_heads.extend((dk.shape[1], dv.shape[1]))
        return dq, dk, dv

    monkeypatch.setattr(attention_chunk, "_kernel_backward", recording)
    for chunk in (7,):                 # chunks cut the query runs and documents anywhere
        out, *grads = _chunked(q.detach(), k.detach(), v.detach(), grad, chunk, documents)
        torch.testing.assert_close(out, ref, **TOL)
        for g, r, name in zip(grads, ref_grads, "qkv"):
            torch.testing.assert_close(g, r, **TOL, msg=lambda m: f"chunk {chunk} d{name}: {m}")
    assert key_heads and set(key_heads) == {hkv}      # GQA: never one dK per query head


def test_the_cuda_calls_on_meta_tensors():
    """The CUDA branch (flash attention's varlen call per block, one sequence per row) on meta
    tensors, whose kernels give CUDA's shapes: forward and backward run, every dK with the KV
    heads, the merged output and lse at the queries' shape."""
    meta = dict(device="meta", dtype=torch.bfloat16)
    q, k = torch.empty(B, 4, 14, D_HEAD, **meta), torch.empty(B, 2, 7, D_HEAD, **meta)
    merged = MergedAttention(q)
    chunk_forward(merged, q, k, k, Q_RUNS, ((0, 7, 0),))
    out = merged.out.to(q.dtype)
    dq, dk, dv = (torch.zeros(t.shape, device="meta") for t in (q, k, k))
    chunk_backward(out, q, k, k, out, merged.lse, Q_RUNS, ((0, 7, 0),), dq, dk, dv)
    assert merged.lse.shape == (B, 4, 14) and dk.shape == (B, 2, 7, D_HEAD)


def test_blocks_of_a_zigzag_chunk():
    """Rank 1 of 2 (local 8 tokens: positions 4..7 and 8..11 of 16) against chunk [2, 6) of every
    rank: rank 0's keys at 2, 3 and 12, 13, rank 1's at 6, 7 and 8, 9. Queries 4, 5 see none of
    them, 6, 7 keys 2, 3 and their diagonal; 8, 9 keys 2, 3, 6, 7 and their diagonal, 10, 11 also
    8, 9; keys 12, 13 come after every query."""
    runs = key_runs(2, 8, 2, 6)
    assert runs == ((0, 2, 2), (2, 4, 12), (4, 6, 6), (6, 8, 8))
    blocks = plan_blocks(((0, 4, 4), (4, 8, 8)), runs)
    full = {(b.q0, b.q1, b.k0, b.k1) for b in blocks if not b.causal}
    causal = {(b.q0, b.q1, b.k0, b.k1) for b in blocks if b.causal}
    assert full == {(0, 4, 0, 2), (4, 8, 0, 2), (4, 8, 4, 6), (6, 8, 6, 8)}
    assert causal == {(2, 4, 4, 6), (4, 6, 6, 8)}
    assert len(blocks) == 6


def test_auto_chunk_is_unchunked_until_the_bound():
    """llama3_8b at 128K on 8 ranks: 16,384 local tokens, one KV head an item, d 128, bf16: the
    gathered K/V is 8 x 2 x 128 x 2 = 4 KiB a local token, 64 MiB in all: one chunk (unchunked)."""
    per_token = 8 * 2 * 1 * 128 * 2
    assert auto_attention_chunk_tokens(16_384, per_token) == 16_384
    most = DEFAULT_KV_BLOCK_BYTES // per_token                         # 262,144 local tokens
    assert auto_attention_chunk_tokens(most, per_token) == most
    assert auto_attention_chunk_tokens(most + 1, per_token) == (most + 2) // 2
    assert resolve_attention_chunk_tokens(5, 3, per_token) == 3
    with pytest.raises(ValueError, match="parallel.attention_chunk_tokens=0 must be 'auto' or an integer"):
        resolve_attention_chunk_tokens(0, 3, per_token)


def test_block_in_chunks_equals_the_block_unchunked():
    """The CPU run of the GPU twin (tests/gpu/test_gpu_chunked_attention.py): one TSP attention
    block on one rank, fp32, document masking, K/V in chunks of 37 tokens (not dividing 200)
    against one chunk."""
    runs = [attention_block_step("cpu", torch.float32, seq=200, chunk=c, hidden=64, lengths=[100, 37, 1, 62],
                                 recompute="selective") for c in (37, "auto")]
    torch.testing.assert_close(runs[0]["out"], runs[1]["out"], **TOL)
    for g, r in zip(runs[0]["grads"], runs[1]["grads"]):
        torch.testing.assert_close(g, r, **TOL)
