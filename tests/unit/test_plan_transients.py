"""Transient formulas of the planner (plan/transients.py) against the code they describe, run on
real tensors with the live-bytes tracker (tools/memory.py)."""

from __future__ import annotations

import pytest
import torch

from tsp_trainer.parallel.gated_mlp import gate_up, gated_mlp_backward_into
from tsp_trainer.plan.transients import _mlp_chunk_backward
from tsp_trainer.tools.memory import LiveTensorMemory


def _chunk_backward_peak(tokens: int, h: int, inter: int, *, kept: bool) -> int:
    """Live-bytes peak of one bf16 chunk of the MLP's backward (gated_mlp_backward_into with one
    chunk), beyond its inputs, preallocated accumulators and (kept) gate/up pre-activations."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, dtype=torch.bfloat16, generator=gen)

    x, dy = rand(tokens, h), rand(tokens, h)
    ws = [rand(inter, h), rand(inter, h), rand(h, inter)]
    acc = [torch.zeros(w.shape) for w in ws]
    dx = torch.zeros(tokens, h, dtype=torch.bfloat16)
    pairs = [gate_up(x, ws)] if kept else None
    tracker = LiveTensorMemory()
    tracker.ignore(x, dy, *ws, *acc, dx, *(pairs[0] if kept else ()))
    with tracker:
        gated_mlp_backward_into(x, dy, ws, acc, dx, [slice(0, tokens)], pairs)
    return tracker.peak


@pytest.mark.parametrize("kept", [True, False], ids=["gate-up-kept", "gate-up-rerun"])
def test_mlp_chunk_backward_counts_the_dx_product_when_h_exceeds_the_shard(kept):
    """h = 4 I/D (Llama-3.1-8B at D = 8 has h / (I/D) = 2.3): the chunk's peak is its last line,
    sigmoid(g), silu(g), dg, du (and re-run g, u) with the [m, h] product added into dX, to the
    byte: 4 (6) intermediates of [m, I/D] and e m h."""
    m, h, inter = 512, 256, 64
    mid, product = 2 * m * inter, 2 * m * h
    expected = (4 if kept else 6) * mid + product
    assert _mlp_chunk_backward(mid, product, kept=kept) == expected
    assert _chunk_backward_peak(m, h, inter, kept=kept) == expected       # 524,288 / 655,360 B


def test_mlp_chunk_backward_without_the_product_is_the_elementwise_count():
    """Untiled (no product term: the final cast, counted apart, has its size) the chunk's
    backward is its elementwise part: 5 intermediates with g, u kept, 6 re-running them."""
    assert _mlp_chunk_backward(1000, 0, kept=True) == 5000
    assert _mlp_chunk_backward(1000, 0, kept=False) == 6000
