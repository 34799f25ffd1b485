"""The GPU twin of the GQA-native attention path (model/attention_gqa.py; CPU run:
tests/unit/test_attention_gqa.py): CUDA, bf16, the flash route's default under GQA against SDPA's
own GQA (SdpaRoute("flash") with enable_gqa: FA2, whose backward writes dK/dV per query head).

* the output and dQ, dK, dV agree to bf16 rounding: square causal, zigzag runs against their key
  prefix, document masking (varlen);
* the backward's peak (torch.cuda.max_memory_allocated above what the forward left) is lower: the
  native path never holds dK/dV [B, Hq, n_k, d].

Run with `python -m pytest -m gpu`; without a CUDA device every test here is skipped."""

from __future__ import annotations

import pytest
import torch

from tsp_trainer.model.attention_route import SdpaRoute, sdpa_route
from tsp_trainer.model.documents import Documents
from tsp_trainer.model.layers import PositionRuns, attention_core

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA device (torch.cuda.is_available() is False)")]

CUDA = "cuda"
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128          # Llama-3-8B's attention: G = 4
FUSED = SdpaRoute("flash")                      # SDPA enable_gqa: FA2's own GQA
REL_ERR = 2e-2                                  # bf16 rounding, as tests/gpu/test_gpu_paths.py


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def _zigzag(seq: int, ranks: int, rank: int) -> PositionRuns:
    """Rank `rank`'s two zigzag chunks of `seq` tokens over `ranks` ranks."""
    c = seq // (2 * ranks)
    return PositionRuns(((rank * c, c), ((2 * ranks - 1 - rank) * c, c)))


def _step(seq: int, runs: PositionRuns | None, documents, route, seed: int = 0) -> dict:
    """Forward and backward of attention_core over k, v [1, seq, KV_HEADS, d] and the queries at
    `runs` (None: all); the output, dq, dk, dv and the backward's peak bytes above the forward's
    end."""
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    kw = dict(device=CUDA, dtype=torch.bfloat16, generator=gen)
    q_all = torch.randn(1, seq, HEADS, HEAD_DIM, **kw)
    q = (q_all if runs is None else q_all[:, runs.tensor().to(CUDA)]).requires_grad_()
    k, v = (torch.randn(1, seq, KV_HEADS, HEAD_DIM, **kw).requires_grad_() for _ in range(2))
    q_runs = None if runs is None else runs.query_runs()
    out = attention_core(q, k, v, q_runs, route=route, documents=documents)
    dout = torch.randn(out.shape, **kw)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    grads = torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return {"out": out.detach(), "grads": grads, "peak": peak}


def test_the_flash_route_is_gqa_native():
    assert sdpa_route(CUDA, torch.bfloat16, gqa=True, head_dim=HEAD_DIM).gqa_native


@pytest.mark.parametrize("shape", ["square", "zigzag", "documents"])
def test_native_gqa_equals_sdpa_enable_gqa_on_cuda(shape):
    seq = 8192
    runs = None if shape == "square" else _zigzag(seq, 4, 1)
    documents = Documents.from_lengths([[3000, 1, 2095, 3096]]) if shape == "documents" else None
    native = _step(seq, runs, documents, route=None)                 # the default route
    fused = _step(seq, runs, documents, route=FUSED)
    assert _rel_err(native["out"], fused["out"]) < REL_ERR
    for name, g, r in zip("qkv", native["grads"], fused["grads"]):
        assert torch.isfinite(g).all() and _rel_err(g, r) < REL_ERR, f"d{name}"


@pytest.mark.parametrize("shape", ["square", "zigzag"])
def test_native_gqa_backward_peaks_lower_than_sdpa_enable_gqa(shape):
    """FA2's GQA backward holds dK, dV per query head, 2 x 2 x seq x 32 x 128 bytes (1 GiB at 64K
    tokens) for a square call; the native path's per-KV-head buffers are a quarter of it. A zigzag
    rank's fused calls run one per query run, each against its own key prefix, and free their
    expanded buffers in between: the native path's peak is lower there too, by less."""
    seq = 65536
    runs = None if shape == "square" else _zigzag(seq, 8, 3)
    native = _step(seq, runs, None, route=None)
    fused = _step(seq, runs, None, route=FUSED)
    expanded = 2 * 2 * seq * HEADS * HEAD_DIM
    assert native["peak"] < fused["peak"], (native["peak"], fused["peak"])
    if shape == "square":
        assert fused["peak"] - native["peak"] >= expanded // 4, (native["peak"], fused["peak"])


def test_a_gqa_model_trains_the_same_on_either_path():
    """A whole GQA model on CUDA in bf16, built with train.attention_gqa's two values: one forward
    and backward each, the loss and every gradient agreeing to bf16 rounding (the fused path is
    auto's choice at 128K, the native path at millions of tokens)."""
    from tests.distributed.tsp_cases import init_model, make_batch
    from tsp_trainer.config import model_config
    from tsp_trainer.model import Transformer

    cfg = model_config("tiny", num_heads=8, num_kv_heads=2)
    ids, labels = (t.to(CUDA) for t in make_batch(cfg, 2, 512))
    runs = {}
    for path in ("native", "fused"):
        model = Transformer(cfg, attention_gqa=path)
        init_model(model, 7)
        model.to(device=CUDA, dtype=torch.bfloat16)
        loss = model.loss(ids, labels)
        loss.backward()
        runs[path] = (loss.float().item(), {n: p.grad.float() for n, p in model.named_parameters()})
    (native_loss, native_grads), (fused_loss, fused_grads) = runs["native"], runs["fused"]
    assert native_loss == pytest.approx(fused_loss, rel=1e-2)
    for name, g in native_grads.items():
        assert torch.isfinite(g).all() and _rel_err(g, fused_grads[name]) < REL_ERR, name
