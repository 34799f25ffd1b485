"""RmsNormFn (model/rms_norm.py) against the plain autograd expression it replaced: the same forward
bit for bit, gradients to fp32 rounding and as accurate against fp64, chunked backward equal to one chunk,
bf16 gradients no worse than autograd's, and the memory promise: only x and rstd saved, no
full-size fp32 temporary in the forward or the backward."""

from __future__ import annotations

import pytest
import torch

from tsp_trainer.model import rms_norm as rn
from tsp_trainer.model.layers import RMSNorm


def reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The RMSNorm math before RmsNormFn (autograd differentiates every op)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return normed.to(x.dtype) * w


def _inputs(dtype, shape=(2, 48, 64), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype)
    dy = torch.randn(shape, generator=g).to(dtype)
    return x, w, dy


def _grads(fn, x, w, dy, eps=1e-5):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(x, w, eps)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def test_fp32_forward_is_bit_identical_and_gradients_agree():
    x, w, dy = _inputs(torch.float32)
    y, dx, dw = _grads(rn.rms_norm, x, w, dy)
    y_ref, dx_ref, dw_ref = _grads(reference, x, w, dy)
    assert torch.equal(y, y_ref)
    torch.testing.assert_close(dx, dx_ref, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(dw, dw_ref, rtol=2e-6, atol=2e-6)


def _reference64(x, w, eps):
    """The exact math in fp64 throughout (the reference's x.float() would round to fp32)."""
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_fp32_gradients_are_as_accurate_as_autograds():
    """Against the fp64 gradient: the closed form is no less accurate than the chain rule."""
    x, w, dy = _inputs(torch.float32, shape=(4, 256, 64))
    _, dx_true, dw_true = _grads(_reference64, x.double(), w.double(), dy.double())
    _, dx, dw = _grads(rn.rms_norm, x, w, dy)
    _, dx_ref, dw_ref = _grads(reference, x, w, dy)
    for new, old, true in ((dx, dx_ref, dx_true), (dw, dw_ref, dw_true)):
        err_new = (new.double() - true).abs().max().item()
        err_old = (old.double() - true).abs().max().item()
        assert err_new <= 2 * err_old + 1e-7, (err_new, err_old)


def test_chunked_backward_equals_one_chunk(monkeypatch):
    x, w, dy = _inputs(torch.float32, shape=(1, 100, 64))
    _, dx_one, dw_one = _grads(rn.rms_norm, x, w, dy)
    monkeypatch.setattr(rn, "CHUNK_BYTES", 7 * 4 * 64)   # 7 tokens per chunk, ragged end
    assert rn.chunk_rows(64) == 7
    _, dx, dw = _grads(rn.rms_norm, x, w, dy)
    assert torch.equal(dx, dx_one)          # per-token math: identical
    torch.testing.assert_close(dw, dw_one, rtol=1e-5, atol=1e-5)   # fp32 sums in another order


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_forward_equals_one_chunk_and_the_plain_expression(monkeypatch, dtype):
    x, w, _ = _inputs(dtype, shape=(2, 50, 64))
    y_one = rn.rms_norm(x, w, 1e-5)
    monkeypatch.setattr(rn, "CHUNK_BYTES", 7 * 4 * 64)   # 7 tokens per chunk, ragged end
    y = rn.rms_norm(x, w, 1e-5)
    assert torch.equal(y, y_one) and torch.equal(y, reference(x, w, 1e-5))


def test_forward_holds_its_output_and_one_chunk_of_fp32_temporaries(monkeypatch):
    """The forward's transient: y and rstd, plus fp32 temporaries of one chunk (x.float(), its
    square, the normalised chunk, its cast), never an fp32 [tokens, h] copy of x."""
    from tsp_trainer.tools.memory import LiveTensorMemory

    monkeypatch.setattr(rn, "CHUNK_BYTES", 16 * 4 * 64)  # 16 tokens per chunk
    x, w, _ = _inputs(torch.bfloat16, shape=(1, 512, 64))
    mem = LiveTensorMemory()
    mem.ignore(x, w)
    with mem:
        rn.rms_norm(x, w, 1e-5)
    chunk32 = 16 * 64 * 4
    # y [512, 64] bf16, rstd [512, 1] fp32; a chunk's x.float() and its square (or the normalised
    # chunk and its bf16 cast) at once; one pass would add 2 fp32 [512, 64] (256 KiB)
    assert mem.peak <= x.numel() * 2 + 512 * 4 + 2 * chunk32 + chunk32 // 2, mem.peak


def test_bf16_gradients_are_at_least_as_close_to_fp64_as_autograds():
    x, w, dy = _inputs(torch.bfloat16, shape=(4, 256, 64))
    _, dx_true, dw_true = _grads(_reference64, x.double(), w.double(), dy.double())
    y, dx, dw = _grads(rn.rms_norm, x, w, dy)
    y_ref, dx_ref, dw_ref = _grads(reference, x, w, dy)
    assert y.dtype == dx.dtype == dw.dtype == torch.bfloat16
    assert torch.equal(y, y_ref)
    for new, old, true in ((dx, dx_ref, dx_true), (dw, dw_ref, dw_true)):
        err_new = (new.double() - true).abs().max()
        err_old = (old.double() - true).abs().max()
        assert err_new <= err_old * 1.01 + 1e-12, (err_new, err_old)


def test_mixed_bf16_input_fp32_weight_promotes_like_autograd():
    x, _, _ = _inputs(torch.bfloat16)
    _, w, dy = _inputs(torch.float32)
    y, dx, dw = _grads(rn.rms_norm, x, w, dy)
    y_ref, dx_ref, dw_ref = _grads(reference, x, w, dy)
    assert (y.dtype, dx.dtype, dw.dtype) == (torch.float32, torch.bfloat16, torch.float32)
    assert torch.equal(y, y_ref)
    # autograd rounds d(normed) to bf16 (the dtype of normed.to(x.dtype)); RmsNormFn keeps it in
    # fp32, so its dx is at least as close to the fp64 gradient
    _, dx_true, dw_true = _grads(_reference64, x.double(), w.double(), dy.double())
    for new, old, true in ((dx, dx_ref, dx_true), (dw, dw_ref, dw_true)):
        assert (new.double() - true).abs().max() <= (old.double() - true).abs().max() * 1.01 + 1e-6


def test_module_uses_the_function_and_passes_an_explicit_weight():
    norm = RMSNorm(64, eps=1e-6)
    x, w, _ = _inputs(torch.float32)
    assert torch.equal(norm(x, w), reference(x, w, 1e-6))
    y = norm(x.requires_grad_())
    assert type(y.grad_fn).__name__ == "RmsNormFnBackward"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saves_only_x_and_rstd(dtype):
    x, w, _ = _inputs(dtype, shape=(1, 512, 64))
    x.requires_grad_(), w.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        rn.rms_norm(x, w, 1e-5)
    sizes = sorted(t.numel() * t.element_size() for t in saved)
    # w [64] (a parameter: no new memory), rstd [512, 1] fp32, x itself
    assert sizes == sorted([64 * x.element_size(), 512 * 4, x.numel() * x.element_size()])
    assert any(t is x for t in saved)


def test_backward_holds_no_full_size_fp32_temporary(monkeypatch):
    """On a tracked run (torch's MemTracker-free way: count live bytes with a dispatch mode), the
    backward's largest allocation beyond dx is one chunk, not [tokens, h] fp32."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.largest = max(self.largest, t.numel() * t.element_size())
            return out

    n, h = 4096, 64
    monkeypatch.setattr(rn, "CHUNK_BYTES", 256 * 4 * h)    # 256-token chunks
    x, w, dy = _inputs(torch.bfloat16, shape=(1, n, h))
    x.requires_grad_(), w.requires_grad_()
    y = rn.rms_norm(x, w, 1e-5)
    with Largest() as mode:
        y.backward(dy)
    # dx (bf16, n x h) is the only full-size tensor; every fp32 temporary is one chunk
    assert mode.largest == max(2 * n * h, 4 * 256 * h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_remade_from_kept_rstd_and_backward_in_place_equal_the_function(monkeypatch, dtype):
    """What a layer that takes over the norm uses (parallel/tsp/norm.py): rstd, the output remade
    from it (any rows, chunked with a ragged end) and the backward written over the incoming
    gradient: the function's own output and gradients, bit for bit."""
    monkeypatch.setattr(rn, "CHUNK_BYTES", 7 * 4 * 64)   # 7 tokens per chunk, ragged end
    x, w, dy = _inputs(dtype, shape=(1, 50, 64))
    y, dx, dw = _grads(rn.rms_norm, x, w, dy)
    x2, dy2 = x.view(-1, 64), dy.view(-1, 64)
    rstd = rn.rms_norm_rstd(x2, 1e-5)
    assert torch.equal(rn.rms_norm_apply(x2, rstd, w, 1e-5), y.view(-1, 64))
    assert torch.equal(rn.rms_norm_apply(x2[11:30], rstd[11:30], w, 1e-5), y.view(-1, 64)[11:30])
    grad = dy2.clone()
    dw_in_place = rn.rms_norm_backward_in_place(x2, rstd, w, grad)
    assert torch.equal(grad, dx.view(-1, 64)) and torch.equal(dw_in_place.to(dtype), dw)
