"""The GQA-native attention path (model/attention_gqa.py), one process, fp32 on CPU: against the
route it replaces (`attention_core`'s CPU route, SDPA with enable_gqa / the log-sum-exp merge) for
square causal calls, zigzag query runs against their key prefix and document masking, GQA and MHA:
output, dQ, dK, dV; the whole model's logits, loss and every gradient under the path. Every kernel
call takes the KV heads only (no dK/dV per query head), and the calls are counted exactly: a causal
block G, a full block 1; under document masking on CUDA the varlen call runs once per group member
(its CPU twin here, a reference varlen kernel). The CUDA branch (flash attention's varlen calls)
runs on meta tensors."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.tsp_cases import init_model, make_batch
from tests.helpers.gqa_route import native_gqa_route
from tests.unit.test_document_masking import _reference_varlen_kernel, zigzag_runs_of
from tsp_trainer.config import ModelConfig
from tsp_trainer.model import Transformer, attention_chunk
from tsp_trainer.model.attention_gqa import grouped_kernel_calls, grouped_query_attention
from tsp_trainer.model.attention_route import SdpaRoute, grouped_varlen_attention, varlen_attention
from tsp_trainer.model.documents import Documents, plan_segments, varlen_plan
from tsp_trainer.model.layers import PositionRuns, attention_core

B, S, D_HEAD = 2, 24, 8
Q_TOKENS = list(range(4, 10)) + list(range(16, 24))          # two runs, as a zigzag rank holds
Q_RUNS = ((0, 6, 4), (6, 14, 16))
DOCS = Documents.from_lengths([[5, 11, 8], [1, 16, 7]])
TOL = dict(rtol=1e-5, atol=1e-6)
NATIVE = SdpaRoute("cpu_lse_merge", gqa_native=True)


class _KernelCalls:
    """Counts attention_chunk's kernel calls and records the heads of every K/V and dK/dV."""

    def __init__(self, monkeypatch):
        self.forward = self.backward = 0
        self.key_heads: set[int] = set()
        fwd, bwd = attention_chunk._kernel_forward, attention_chunk._kernel_backward

        def counted_forward(q, k, v, causal):
            self.forward += 1
            self.key_heads.add(k.shape[1])
            return fwd(q, k, v, causal)

        def counted_backward(*args):
            self.backward += 1
            dq, dk, dv = bwd(*args)
            self.key_heads.update((dk.shape[1], dv.shape[1]))
            return dq, dk, dv

        monkeypatch.setattr(attention_chunk, "_kernel_forward", counted_forward)
        monkeypatch.setattr(attention_chunk, "_kernel_backward", counted_backward)


def _inputs(hq: int, hkv: int, runs):
    gen = torch.Generator().manual_seed(hq * 10 + hkv)
    q = torch.randn(B, S, hq, D_HEAD, generator=gen)
    q = (q if runs is None else q[:, Q_TOKENS]).requires_grad_()
    k, v = (torch.randn(B, S, hkv, D_HEAD, generator=gen).requires_grad_() for _ in range(2))
    return q, k, v, gen


@pytest.mark.parametrize("runs", [None, Q_RUNS], ids=["square", "zigzag_runs"])
@pytest.mark.parametrize("documents", [None, DOCS], ids=["", "documents"])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (6, 2), (8, 1)], ids=["G2", "G3", "G8"])
def test_native_gqa_equals_the_fused_route(hq, hkv, runs, documents, monkeypatch):
    q, k, v, gen = _inputs(hq, hkv, runs)
    ref = attention_core(q, k, v, runs, documents=documents)            # the CPU route, enable_gqa
    grad = torch.randn(ref.shape, generator=gen)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    calls = _KernelCalls(monkeypatch)
    out = attention_core(q, k, v, runs, documents=documents, route=NATIVE)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    torch.testing.assert_close(out, ref, **TOL)
    for g, r, name in zip(grads, ref_grads, "qkv"):
        torch.testing.assert_close(g, r, **TOL, msg=lambda m: f"d{name}: {m}")
    assert calls.key_heads == {hkv}                    # never K/V or dK/dV per query head
    expected = grouped_kernel_calls(runs, q.shape[1], S, hq // hkv, documents)
    assert calls.forward == calls.backward == expected


def test_kernel_calls_per_shape_of_call():
    """Square causal: G calls; a zigzag run against its prefix: 1 (the prefix, the group stacked)
    + G (the diagonal); a run at position 0 has no prefix; documents cut the runs, and every row
    has its own calls."""
    assert grouped_kernel_calls(None, S, S, 4) == 4
    assert grouped_kernel_calls(((0, S, 0),), S, S, 4) == 4
    assert grouped_kernel_calls(Q_RUNS, 14, S, 3) == 2 * (1 + 3)
    assert grouped_kernel_calls(((0, 6, 0), (6, 12, 18)), 12, S, 2) == 2 + (1 + 2)
    # row 0's documents [0, 5), [5, 16), [16, 24): query 4 (document 0: keys 0..3 full, its
    # diagonal causal), queries 5..9 (document 1, causal), 16..23 (document 2, causal): 1 + 3 G.
    # Row 1's [0, 1), [1, 17), [17, 24): queries 4..9 (keys 1..3 full + causal), 16 (keys 1..15
    # full + causal), 17..23 (causal): 2 + 3 G
    g = 2
    assert grouped_kernel_calls(Q_RUNS, 14, S, g, DOCS) == (1 + 3 * g) + (2 + 3 * g)


def test_mha_through_the_native_call():
    """With as many KV heads as query heads (G = 1) the per-group code is plain multi-head
    attention; attention_core keeps MHA on the route's own calls."""
    q, k, v, gen = _inputs(4, 4, Q_RUNS)
    ref = attention_core(q, k, v, Q_RUNS, documents=DOCS)
    grad = torch.randn(ref.shape, generator=gen)
    out = grouped_query_attention(*(t.transpose(1, 2) for t in (q, k, v)), Q_RUNS, DOCS)
    out = out.transpose(1, 2).reshape(ref.shape)
    torch.testing.assert_close(out, ref, **TOL)
    for g, r in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(g, r, **TOL)


CFG = ModelConfig(vocab_size=128, hidden_size=48, num_layers=2, num_heads=6, num_kv_heads=2,
                  intermediate_size=96, max_seq_len=64, qkv_bias=True, o_bias=True)


@pytest.mark.parametrize("cfg", [CFG, CFG.replace(num_kv_heads=6)], ids=["gqa", "mha"])
@pytest.mark.parametrize("documents", [False, True], ids=["", "documents"])
def test_model_logits_loss_and_gradients_under_the_native_path(cfg, documents):
    """The whole model, one process: logits, loss and every gradient equal the fused route's;
    under GQA every attention call (forward, the logits' forward, and none in backward: autograd)
    takes the native path, under MHA none does."""
    ids, labels = make_batch(cfg, 2, 32)
    docs = Documents.from_lengths([[7, 20, 5], [32]]) if documents else None
    pos = PositionRuns.contiguous(32).with_documents(docs) if documents else None

    def run():
        model = Transformer(cfg)
        init_model(model, 3)
        logits = model(ids, pos).detach()
        loss_sum, count = model.loss_sum(ids, labels, pos)
        (loss_sum / count).backward()
        return logits, (loss_sum / count).detach(), {n: p.grad for n, p in model.named_parameters()}

    ref = run()
    with native_gqa_route() as native:
        got = run()
    gqa = cfg.num_heads != cfg.num_kv_heads
    assert native["grouped"] == (2 * cfg.num_layers if gqa else 0)
    torch.testing.assert_close(got[0], ref[0], **TOL)
    torch.testing.assert_close(got[1], ref[1], **TOL)
    for name, g in ref[2].items():
        torch.testing.assert_close(got[2][name], g, **TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("rank,degree", [(0, 1), (1, 2), (3, 4)])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (6, 2)], ids=["G2", "G3"])
def test_grouped_varlen_call_equals_the_fused_varlen_call(rank, degree, hq, hkv):
    """Document masking on CUDA: the keys packed once, one varlen call per group member with the
    KV heads (the CPU twin, a reference varlen kernel) equals the fused varlen call (K/V heads
    repeated inside the reference, as FA2's own GQA), forward and backward: G calls a row, each
    with as many query heads as KV heads, whatever the number of documents."""
    torch.manual_seed(rank)
    s, docs = 24, (0, 7, 8, 19)
    runs = zigzag_runs_of(s, rank, degree)
    tq = sum(b - a for a, b, _ in runs)
    q = torch.randn(1, hq, tq, 8, requires_grad=True)
    k, v = (torch.randn(1, hkv, s, 8, requires_grad=True) for _ in range(2))
    plan = varlen_plan(plan_segments(runs, docs))
    heads = []

    def kernel(qp, kp, vp, *offsets):
        heads.append((qp.shape[1], kp.shape[1]))
        return _reference_varlen_kernel(qp, kp, vp, *offsets)

    ref = varlen_attention(q, k, v, plan, _reference_varlen_kernel)
    out = grouped_varlen_attention(q, k, v, plan, kernel)
    torch.testing.assert_close(out, ref, **TOL)
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, **TOL)
    assert heads == [(hkv, hkv)] * (hq // hkv)


def test_the_cuda_calls_on_meta_tensors():
    """The CUDA branch (flash attention's varlen call per block) on meta tensors, whose kernels
    give CUDA's shapes: square and zigzag calls run forward and backward, dK/dV at the KV heads."""
    meta = dict(device="meta", dtype=torch.bfloat16)
    for runs, tq in ((None, S), (Q_RUNS, 14)):
        q = torch.empty(B, 6, tq, D_HEAD, **meta, requires_grad=True)
        k, v = (torch.empty(B, 2, S, D_HEAD, **meta, requires_grad=True) for _ in range(2))
        out = grouped_query_attention(q, k, v, runs)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.empty_like(out))
        assert out.shape == dq.shape == q.shape and dk.shape == dv.shape == (B, 2, S, D_HEAD)
