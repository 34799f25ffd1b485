"""parallel/gated_mlp.py `add_matmul` on CUDA: bf16 operands into an fp32 accumulator run as one
GEMM that reads and writes the accumulator in fp32 (no bf16 product rounded on the way), in place.
Run with `python -m pytest -m gpu`; without a CUDA device every test here is skipped."""

import pytest
import torch

from tsp_trainer.parallel.gated_mlp import add_matmul, gemm_writes_fp32

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA device (torch.cuda.is_available() is False)")]


def test_bf16_gemm_accumulates_into_fp32_without_rounding_the_product():
    out = torch.full((1, 2), 0.5, device="cuda")
    a = torch.tensor([[1.0, 2.0 ** -10]], dtype=torch.bfloat16, device="cuda")   # a @ b = 1 + 2^-10
    b = torch.ones(2, 2, dtype=torch.bfloat16, device="cuda")
    ptr = out.data_ptr()
    assert gemm_writes_fp32(out, a)
    add_matmul(out, a, b)
    assert out.data_ptr() == ptr
    assert out.tolist() == [[1.5 + 2.0 ** -10] * 2]      # the bf16 product would have been 1.0


@pytest.mark.parametrize("transposed", [False, True])
def test_bf16_into_fp32_matches_the_fp64_sum_on_a_packed_buffer_view(transposed):
    gen = torch.Generator(device="cuda").manual_seed(0)
    buf = torch.randn(96, 64, device="cuda", generator=gen)
    out = buf[16:80]                                      # a row range of a packed buffer
    a = torch.randn(128, 64, device="cuda", generator=gen).bfloat16()
    a = a.t() if transposed else a[:64, :]                # dW-style a^T or an [m, k] operand
    b = torch.randn(a.shape[1], 64, device="cuda", generator=gen).bfloat16()
    expected = out.double() + a.double() @ b.double()
    before = (buf[:16].clone(), buf[80:].clone())
    add_matmul(out, a, b)
    err = (out.double() - expected).abs().max().item() / expected.abs().max().item()
    assert err < 1e-4, err                                # fp32 accumulation; a bf16 product: ~4e-3
    assert torch.equal(buf[:16], before[0]) and torch.equal(buf[80:], before[1])
