"""The CUDA attention dispatch, checked on CPU (model/attention_route.py): the pure decision table,
and a CPU-run twin of the CUDA route (the same SDPA calls with torch's lower-right CausalBias, K/V
heads expanded for the memory-efficient kernel) against the plain causal reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from tsp_trainer.model.attention_route import (SdpaRoute, UnsupportedAttentionError,
                                               check_cuda_attention, sdpa_route)
from tsp_trainer.model.layers import PositionRuns, attention_core


@pytest.mark.parametrize("dtype,gqa,head_dim,expected", [
    # the 7B recipe: flash, GQA native (per-group-member calls with the KV heads)
    (torch.bfloat16, True, 128, SdpaRoute("flash", gqa_native=True)),
    (torch.bfloat16, False, 128, SdpaRoute("flash")),
    (torch.float16, True, 256, SdpaRoute("flash", gqa_native=True)),
    (torch.bfloat16, True, 100, SdpaRoute("flash")),      # SDPA pads head_dim 100: FA2's own GQA
    (torch.float32, True, 128, SdpaRoute("efficient", expand_kv=True)),   # fp32 + GQA: no dense mask
    (torch.float32, False, 128, SdpaRoute("efficient")),
    (torch.bfloat16, True, 512, SdpaRoute("efficient", expand_kv=True)),  # beyond flash's head_dim
])
def test_cuda_route_is_a_fused_kernel(dtype, gqa, head_dim, expected):
    assert sdpa_route("cuda", dtype, gqa=gqa, head_dim=head_dim) == expected


def test_cpu_route_is_the_lse_merge():
    route = sdpa_route("cpu", torch.float32, gqa=True, head_dim=8)
    assert route.kernel == "cpu_lse_merge" and not route.expand_kv


def test_what_no_fused_kernel_takes_is_refused_naming_shape_and_dtype():
    with pytest.raises(UnsupportedAttentionError, match=r"head_dim=6 in float32 on CUDA.*multiple of 4"):
        check_cuda_attention(num_heads=8, num_kv_heads=2, head_dim=6, dtype=torch.float32)
    with pytest.raises(UnsupportedAttentionError, match=r"head_dim=260 in bfloat16"):
        check_cuda_attention(num_heads=8, num_kv_heads=8, head_dim=260, dtype=torch.bfloat16)


class _SdpaMasks(TorchFunctionMode):
    """Records the attn_mask of every SDPA call."""

    def __init__(self):
        super().__init__()
        self.masks = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.masks.append(kwargs.get("attn_mask", args[3] if len(args) > 3 else None))
        return func(*args, **kwargs)


@pytest.mark.parametrize("route", [SdpaRoute("flash"), SdpaRoute("efficient", expand_kv=True),
                                   SdpaRoute("efficient")], ids=["flash", "efficient+expand", "efficient"])
def test_cuda_route_run_on_cpu_matches_the_causal_reference(route):
    """The CUDA route's math on CPU tensors: zigzag runs (chunks 1 and 6 of 8, and 0 and 7) with
    GQA (8 query heads, 2 K/V heads), passed as runs; SDPA gets a lower-right CausalBias per run,
    never a dense mask (on a GPU that is what keeps the fused kernels)."""
    torch.manual_seed(0)
    s, c = 64, 8
    q, k, v = torch.randn(2, s, 8, 16), torch.randn(2, s, 2, 16), torch.randn(2, s, 2, 16)
    reference = attention_core(q, k, v)                        # plain causal over the whole sequence
    for chunks in ((1, 6), (0, 7)):
        runs = PositionRuns(tuple((ch * c, c) for ch in chunks))
        pos = runs.tensor()
        with _SdpaMasks() as seen:
            out = attention_core(q[:, pos], k, v, runs.query_runs(), route)
        torch.testing.assert_close(out, reference[:, pos], rtol=1e-5, atol=1e-5)
        assert seen.masks and all(m is None or isinstance(m, CausalBias) for m in seen.masks)


class _FlashCalls(TorchDispatchMode):
    """Records (is_causal, n_queries, n_keys) of every CPU flash-attention kernel call."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ == "_scaled_dot_product_flash_attention_for_cpu":
            causal = kwargs.get("is_causal", args[4] if len(args) > 4 else False)
            self.calls.append((causal, args[0].shape[2], args[1].shape[2], kwargs.get("attn_mask")))
        return func(*args, **kwargs)


def test_cpu_route_merges_prefix_and_diagonal_without_a_mask():
    """A zigzag chunk's attention is its key prefix (no mask) plus its diagonal
    block (causal), merged by log-sum-exp; no mask exists and no masked-out score is computed."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 32, 4, 8), torch.randn(1, 32, 2, 8), torch.randn(1, 32, 2, 8)
    runs = PositionRuns(((8, 8), (24, 8)))
    with _SdpaMasks() as seen, _FlashCalls() as flash:
        out = attention_core(q[:, runs.tensor()], k, v, runs.query_runs())
    torch.testing.assert_close(out, attention_core(q, k, v)[:, runs.tensor()], rtol=1e-5, atol=1e-6)
    assert seen.masks == []
    assert flash.calls == [(False, 8, 8, None), (True, 8, 8, None),      # chunk at 8: keys 0..7 | 8..15
                           (False, 8, 24, None), (True, 8, 8, None)]     # chunk at 24: keys 0..23 | 24..31


@pytest.mark.parametrize("hq,hkv,n,n_k", [(4, 2, 5, 13), (2, 2, 16, 40), (8, 2, 33, 100), (4, 4, 7, 7)])
def test_lse_merge_equals_the_masked_reference_forward_and_backward(hq, hkv, n, n_k):
    from tsp_trainer.model.attention_lse import prefix_causal_attention

    torch.manual_seed(n)
    q = torch.randn(2, hq, n, 8, requires_grad=True)
    k, v = (torch.randn(2, hkv, n_k, 8, requires_grad=True) for _ in range(2))
    mask = torch.ones(n, n_k, dtype=torch.bool).tril(diagonal=n_k - n)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=hq != hkv)
    out = prefix_causal_attention(q, k, v)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_blocked_mask_route_stays_selectable():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 32, 4, 8), torch.randn(1, 32, 4, 8), torch.randn(1, 32, 4, 8)
    runs = PositionRuns(((8, 8), (24, 8)))
    with _SdpaMasks() as seen:
        out = attention_core(q[:, runs.tensor()], k, v, runs.query_runs(),
                             SdpaRoute("cpu_blocked_mask", query_block=512))
    torch.testing.assert_close(out, attention_core(q, k, v)[:, runs.tensor()], rtol=1e-5, atol=1e-6)
    assert [m.dtype for m in seen.masks] == [torch.bool, torch.bool]


def test_position_runs_round_trip():
    pos = torch.tensor([0, 1, 2, 9, 10, 11, 3])
    runs = PositionRuns.of(pos)
    assert runs.runs == ((0, 3), (9, 3), (3, 1)) and len(runs) == 7
    assert torch.equal(runs.tensor(), pos)
    assert runs.query_runs() == ((0, 3, 0), (3, 6, 9), (6, 7, 3))
