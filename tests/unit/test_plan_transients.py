"""Transient formulas of the planner (plan/transients.py) against the code they describe, run on
real tensors with the live-bytes tracker (tools/memory.py)."""

from __future__ import annotations

import pytest
import torch

from tsp_trainer.parallel.gated_mlp import _gate_up, gated_mlp_backward_into
from tsp_trainer.plan.transients import _mlp_chunk_backward
from tsp_trainer.tools.memory import LiveTensorMemory


def _chunk_backward_peak(tokens: int, h: int, inter: int, *, kept: bool, dx_dtype=torch.bfloat16) -> int:
    """Live-bytes peak of one bf16 chunk of the MLP's backward (gated_mlp_backward_into with one
    chunk, the fused [W_gate; W_up] layout), beyond its inputs, preallocated accumulators and
    (kept) gate|up pre-activations."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, dtype=torch.bfloat16, generator=gen)

    x, dy = rand(tokens, h), rand(tokens, h)
    ws = [rand(2 * inter, h), rand(h, inter)]                  # [W_gate; W_up], W_down
    acc = [torch.zeros(w.shape) for w in ws]
    dx = torch.zeros(tokens, h, dtype=dx_dtype)
    pairs = [_gate_up(x, ws[0], None)] if kept else None
    tracker = LiveTensorMemory()
    tracker.ignore(x, dy, *ws, *acc, dx, *(pairs if kept else ()))
    with tracker:
        gated_mlp_backward_into(x, dy, ws, acc, dx, [slice(0, tokens)], pairs)
    return tracker.peak


@pytest.mark.parametrize("shape", [(512, 256, 64), (512, 64, 256)], ids=["h-over-shard", "shard-over-h"])
@pytest.mark.parametrize("kept", [True, False], ids=["gate-up-kept", "gate-up-rerun"])
def test_mlp_chunk_backward_of_a_tiled_layer_is_its_elementwise_part(kept, shape):
    """A tiled layer's dX is in the activation dtype, so dX += [dg | du] [W_gate; W_up] is one
    in-place addmm_ (no [m, h] product), whether h exceeds I/D (Llama-3.1-8B at D = 8) or not:
    the peak is the elementwise part, 6 (8 re-running gate|up) [m, I/D] intermediates, to the
    byte."""
    m, h, inter = shape
    mid = 2 * m * inter
    expected = (6 if kept else 8) * mid
    assert _mlp_chunk_backward(mid, 0, kept=kept) == expected
    assert _chunk_backward_peak(m, h, inter, kept=kept) == expected


@pytest.mark.parametrize("kept", [True, False], ids=["gate-up-kept", "gate-up-rerun"])
def test_mlp_chunk_backward_with_a_dx_product_is_its_last_line(kept):
    """CPU's bf16 GEMM into an fp32 dX writes a [m, h] product first: with h = 4 I/D the last line,
    4 (6) intermediates and the product, is the peak, to the byte."""
    m, h, inter = 512, 256, 64
    mid, product = 2 * m * inter, 2 * m * h
    expected = (4 if kept else 6) * mid + product
    assert _mlp_chunk_backward(mid, product, kept=kept) == expected
    assert _chunk_backward_peak(m, h, inter, kept=kept, dx_dtype=torch.float32) == expected


def test_attention_in_kv_chunks():
    """llama3_8b on D 8: auto keeps 128K unchunked (the same terms as a forced whole K/V) and
    chunks at 10M, where the attention transients shrink to a chunk's K/V; the ledger model counts
    one K/V gather per chunk and pass, the same bytes, and a second backward pass when full
    recompute recomputes the items."""
    from tsp_trainer.config import model_config
    from tsp_trainer.plan.activations import activation_memory
    from tsp_trainer.plan.communication import model_parallel_comm
    from tsp_trainer.plan.layout import UNTILED, Layout

    cfg = model_config("llama3_8b")

    def memory(seq: int, chunk) -> dict:
        lay = Layout("tsp", 8, dp=1, activation_checkpointing=True, offload_activations=True,
                     attention_chunk_tokens=chunk)
        return activation_memory(cfg.replace(max_seq_len=seq), lay, seq, **lay.chunks).terms

    assert memory(131072, "auto") == memory(131072, UNTILED)
    whole, auto = memory(10_000_384, UNTILED), memory(10_000_384, "auto")
    assert auto["attention_chunk_tokens"] == 250_010 < whole["attention_chunk_tokens"] == 1_250_048
    assert auto["transient_kv_bucket"] * 5 == pytest.approx(whole["transient_kv_bucket"], rel=1e-5)
    assert auto["transient_attn_bwd"] < whole["transient_attn_bwd"]
    seq = 16384
    ledgers = {(c, mode): model_parallel_comm(cfg, Layout("tsp", 8, dp=1, tsp_recompute=mode,
                                                          attention_chunk_tokens=c), seq)
               for c in (UNTILED, 512) for mode in ("full", "selective")}
    for mode, passes in (("selective", 1), ("full", 2)):
        whole_kv, chunked_kv = ledgers[(UNTILED, mode)]["all_gather/attn.kv"], ledgers[(512, mode)]["all_gather/attn.kv"]
        assert chunked_kv["count"] == 4 * (whole_kv["count"] + (passes - 1) * 32 * 8)
        assert chunked_kv["bytes"] == whole_kv["bytes"] * (passes + 1) // 2
