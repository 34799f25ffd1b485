"""The GPU twin of TSP attention with K/V in chunks (parallel.attention_chunk_tokens,
parallel/tsp/chunked.py; CPU run: tests/unit/test_attention_chunk.py): one attention block on one
GPU, bf16, through flash attention's varlen call per block, merged by log-sum-exp.

* in chunks it equals the unchunked block (the flash route, GQA-native: model/attention_gqa.py)
  at the same length, GQA, with and without document masking, chunks that do not divide the length;
* at a length four times longer, in chunks, it needs no more bytes a token than the unchunked block
  at the shorter length: the chunked path never holds the whole sequence's K/V or dK/dV.

Run with `python -m pytest -m gpu`; without a CUDA device every test here is skipped."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.attention_block import attention_block_step

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA device (torch.cuda.is_available() is False)")]

CUDA = "cuda"
HIDDEN, HEADS, KV_HEADS = 1024, 16, 4          # head_dim 64, GQA 4:1
REL_ERR = 2e-2                                  # bf16 rounding, as tests/gpu/test_gpu_paths.py


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("lengths", [None, [3000, 1, 2095, 3096]], ids=["causal", "documents"])
def test_chunked_block_equals_the_unchunked_block_on_cuda(lengths):
    seq = 8192
    runs = [attention_block_step(CUDA, torch.bfloat16, seq=seq, chunk=c, hidden=HIDDEN, heads=HEADS,
                                 kv_heads=KV_HEADS, lengths=lengths) for c in (1000, "auto")]
    assert _rel_err(runs[0]["out"], runs[1]["out"]) < REL_ERR
    for name, g, r in zip(("x", "W_q", "W_k", "W_v", "W_o"), runs[0]["grads"], runs[1]["grads"]):
        assert torch.isfinite(g).all() and _rel_err(g, r) < REL_ERR, name


def test_chunked_block_at_four_times_the_length_needs_no_more_bytes_a_token():
    short, long_ = 65536, 262144
    unchunked = attention_block_step(CUDA, torch.bfloat16, seq=short, chunk="auto", hidden=HIDDEN,
                                     heads=HEADS, kv_heads=KV_HEADS)
    chunked = attention_block_step(CUDA, torch.bfloat16, seq=long_, chunk=8192, hidden=HIDDEN,
                                   heads=HEADS, kv_heads=KV_HEADS)
    assert all(torch.isfinite(g).all() for g in chunked["grads"])
    per_token = {"unchunked": unchunked["peak"] / short, "chunked": chunked["peak"] / long_}
    assert per_token["chunked"] <= 1.05 * per_token["unchunked"], per_token
