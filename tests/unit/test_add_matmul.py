"""parallel/gated_mlp.py `add_matmul`: out += a @ b summed inside one GEMM where the device can,
dispatched on the accumulator's and operands' dtypes and the device (the CUDA fp32-output branch
is tests/gpu/test_gpu_add_matmul.py's; here its call is checked without running it)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tsp_trainer.parallel import gated_mlp
from tsp_trainer.parallel.gated_mlp import add_matmul, gemm_writes_fp32


class _Ops(TorchDispatchMode):
    """Records the aten ops dispatched inside; with `stub`, a baddbmm.dtype_out call is recorded
    with its arguments and not run (CPU has no kernel for it)."""

    def __init__(self, stub: bool = False):
        super().__init__()
        self.ops, self.calls, self.stub = [], [], stub

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops.append(str(func))
        if self.stub and func is torch.ops.aten.baddbmm.dtype_out:
            self.calls.append((args, kwargs))
            return kwargs["out"]
        return func(*args, **kwargs)


def _integers(*shape, seed):
    """Small integers in fp32: their products and sums are exact, so results compare with =="""
    return torch.randint(-4, 5, shape, generator=torch.Generator().manual_seed(seed)).float()


def test_fp32_accumulates_in_place_in_one_addmm_and_exactly():
    out, a, b = _integers(6, 5, seed=0), _integers(6, 3, seed=1), _integers(3, 5, seed=2)
    expected = out + a @ b
    ptr = out.data_ptr()
    with _Ops() as rec:
        add_matmul(out, a, b)
    assert rec.ops == ["aten.addmm_.default"]          # no product tensor, no separate add
    assert out.data_ptr() == ptr and torch.equal(out, expected)


def test_a_transposed_operand_and_a_row_slice_accumulator():
    buf, dy, x = torch.zeros(8, 5), _integers(4, 8, seed=3), _integers(4, 5, seed=4)
    add_matmul(buf[2:6], dy.t()[2:6], x)               # a view of a packed buffer, a^T operand
    assert torch.equal(buf[2:6], dy.t()[2:6] @ x)
    assert buf[:2].abs().sum() == 0 and buf[6:].abs().sum() == 0


def test_bf16_into_bf16_adds_inside_the_gemm():
    out = _integers(6, 5, seed=5).bfloat16()
    a, b = _integers(6, 3, seed=6).bfloat16(), _integers(3, 5, seed=7).bfloat16()
    expected = out.float() + a.float() @ b.float()
    with _Ops() as rec:
        add_matmul(out, a, b)
    assert rec.ops == ["aten.addmm_.default"] and torch.equal(out.float(), expected)


def test_bf16_into_fp32_on_cpu_is_the_product_then_the_add():
    out = torch.zeros(1, 2)
    a = torch.tensor([[1.0, 2.0 ** -10]], dtype=torch.bfloat16)   # a @ b = 1 + 2^-10: not a bf16
    b = torch.ones(2, 2, dtype=torch.bfloat16)
    with _Ops() as rec:
        add_matmul(out, a, b)
    assert "aten.mm.default" in rec.ops and "aten.add_.Tensor" in rec.ops
    assert out.tolist() == [[1.0, 1.0]]                            # the product was rounded to bf16


def test_the_fp32_output_gemm_is_chosen_on_cuda_only_for_bf16_and_fp16_operands():
    f32, bf16 = torch.float32, torch.bfloat16
    for out_device, out_dtype, a_dtype, chosen in (
            ("cuda", f32, bf16, True), ("cuda", f32, torch.float16, True), ("cuda", bf16, bf16, False),
            ("cuda", f32, f32, False), ("cpu", f32, bf16, False), ("meta", f32, bf16, False)):
        out = _FakeDevice(out_device, out_dtype)
        assert gemm_writes_fp32(out, _FakeDevice(out_device, a_dtype)) is chosen, (
            out_device, out_dtype, a_dtype)


class _FakeDevice:
    """Just the attributes gemm_writes_fp32 reads."""

    def __init__(self, device: str, dtype):
        self.device, self.dtype = torch.device(device), dtype


def test_the_cuda_branch_is_one_baddbmm_accumulating_into_out_in_fp32(monkeypatch):
    monkeypatch.setattr(gated_mlp, "gemm_writes_fp32", lambda out, a: True)
    out = torch.zeros(6, 5)
    a, b = torch.ones(3, 6, dtype=torch.bfloat16).t(), torch.ones(3, 5, dtype=torch.bfloat16)
    with _Ops(stub=True) as rec:
        add_matmul(out, a, b)
    assert [op for op in rec.ops if "mm" in op] == ["aten.baddbmm.dtype_out"]
    (args, kwargs), = rec.calls
    self_, batch1, batch2, out_dtype = args
    assert out_dtype == torch.float32
    # out is both the added input and the result: one [1, 6, 5] view of the accumulator
    assert self_.data_ptr() == kwargs["out"].data_ptr() == out.data_ptr()
    assert [tuple(t.shape) for t in (self_, batch1, batch2)] == [(1, 6, 5), (1, 6, 3), (1, 3, 5)]
    assert batch1.dtype == batch2.dtype == torch.bfloat16


@pytest.mark.parametrize("bias", [False, True])
def test_fused_weights_are_free_views_of_the_packed_mlp_shard(bias):
    from tsp_trainer.parallel.tsp.ring import pack, unpack

    inter, h = 3, 4
    params = [torch.randn(inter, h), torch.randn(inter, h), torch.randn(h, inter)]
    params += [torch.randn(inter), torch.randn(inter)] if bias else []
    flat = pack(*params)
    fused = unpack(flat, gated_mlp.fused_weights([tuple(p.shape) for p in params]))
    assert torch.equal(fused[0], torch.cat(params[:2])) and torch.equal(fused[1], params[2])
    storage = flat.untyped_storage().data_ptr()
    assert all(f.untyped_storage().data_ptr() == storage for f in fused)   # views, no copies
    if bias:
        assert torch.equal(fused[2], torch.cat(params[3:]))


@pytest.mark.parametrize("bias", [False, True])
def test_split_gate_up_weights_compute_what_the_fused_views_do(bias):
    """The baselines' separate W_gate, W_up (two GEMMs per step) against TSP's fused views (one):
    the same output, dX and [dW_gate; dW_up], to rounding."""
    from tsp_trainer.parallel.tsp.ring import pack, unpack

    inter, h, n = 3, 4, 5
    params = [_integers(inter, h, seed=10), _integers(inter, h, seed=11), _integers(h, inter, seed=12)]
    params += [_integers(inter, seed=13), _integers(inter, seed=14)] if bias else []
    x, dy = _integers(n, h, seed=15) / 8, _integers(n, h, seed=16) / 8
    shapes = [tuple(p.shape) for p in params]
    out = {}
    for name in ("fused", "split"):
        acc = [torch.zeros(s) for s in shapes]
        y, dx = torch.zeros(n, h), torch.zeros(n, h)
        if name == "fused":
            ws, grads = unpack(pack(*params), gated_mlp.fused_weights(shapes)), unpack(
                pack(*acc), gated_mlp.fused_weights(shapes))
        else:
            ws, grads = gated_mlp.split_gate_up(params), gated_mlp.split_gate_up(acc)
        gated_mlp.gated_mlp_forward_into(x, ws, y, [slice(0, n)])
        gated_mlp.gated_mlp_backward_into(x, dy, ws, grads, dx, [slice(0, n)])
        flat = torch.cat([g.reshape(-1) for g in grads[:1]]) if name == "fused" else torch.cat(
            [grads[0][0].reshape(-1), grads[0][1].reshape(-1)])
        out[name] = (y, dx, flat)
    for a, b in zip(out["fused"], out["split"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert out["fused"][2].abs().sum() > 0
