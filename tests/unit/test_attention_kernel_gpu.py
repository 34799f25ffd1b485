"""Each installed attention kernel on this GPU aligns the zigzag prefix call bottom-right: queries
at positions first..first+n-1 against keys 0..first+n-1, output and gradients against the CPU
log-sum-exp route on the same inputs. `pytest -m gpu`; skipped without CUDA."""

import pytest
import torch

from tsp_trainer.model.attention_kernel import installed_attention_kernels, select_attention_kernel
from tsp_trainer.model.attention_route import SdpaRoute, sdpa_route, use_attention_kernel

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _runnable(kernel: str, *, needs_prefix: bool) -> bool:
    try:
        select_attention_kernel(kernel, capability=torch.cuda.get_device_capability(), dtype="bf16",
                                head_dim=64, gqa=True, available=installed_attention_kernels(),
                                needs_varlen=False, needs_prefix=needs_prefix)
    except ValueError:
        return False
    return True


@pytest.fixture
def kernel_in_use(request):
    kernel = request.param
    if not _runnable(kernel, needs_prefix=kernel != "cudnn"):
        pytest.skip(f"{kernel} cannot run here")
    from tsp_trainer.model.attention_kernel import Choice

    use_attention_kernel(Choice(kernel, "test"))
    yield kernel
    use_attention_kernel(Choice("fa2", "test"))
    assert torch.nn.attention.current_flash_attention_impl() is None


def _inputs(n_q: int, n_k: int):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, n_q, 64, generator=g)
    k, v = (torch.randn(1, 2, n_k, 64, generator=g) for _ in range(2))     # GQA: 4 query heads, 2 K/V
    return q, k, v


def _run(route: SdpaRoute, call: str, q, k, v, device, dtype, **kw):
    q, k, v = (t.to(device, dtype).requires_grad_() for t in (q, k, v))
    if route.expand_kv:
        kk, vv = (t.repeat_interleave(2, dim=1) for t in (k, v))
    else:
        kk, vv = k, v
    with route.kernels(device.type):
        out = getattr(route, call)(q, kk, vv, gqa=not route.expand_kv, **kw)
        out.float().square().sum().backward()
    return [t.float().cpu() for t in (out, q.grad, k.grad, v.grad)]


@pytest.mark.parametrize("kernel_in_use", ["fa2", "fa3", "fa4"], indirect=True)
def test_prefix_call_is_bottom_right_against_the_cpu_route(kernel_in_use):
    first, n = 192, 64
    q, k, v = _inputs(n, first + n)
    route = sdpa_route("cuda", torch.bfloat16, gqa=True, head_dim=64)
    gpu = _run(route, "prefix", q, k, v, torch.device("cuda"), torch.bfloat16, first=first)
    cpu = _run(SdpaRoute("cpu_lse_merge"), "prefix", q, k, v, torch.device("cpu"), torch.float32, first=first)
    for name, got, want in zip(("out", "dq", "dk", "dv"), gpu, cpu):
        torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2, msg=f"{kernel_in_use} {name}")
    # top-left alignment would let query 0 see only key 0: its output would differ by far more
    top_left = torch.softmax((q[0, :1, :1] @ k[0, :1, :1].transpose(-1, -2)) / 8, -1) @ v[0, :1, :1]
    assert (gpu[0][0, 0, 0] - top_left[0, 0]).abs().max() > 0.1


@pytest.mark.parametrize("kernel_in_use", ["cudnn"], indirect=True)
def test_cudnn_square_causal_call_against_the_cpu_route(kernel_in_use):
    q, k, v = _inputs(128, 128)
    route = sdpa_route("cuda", torch.bfloat16, gqa=True, head_dim=64, kernel=kernel_in_use)
    assert route.kernel == "cudnn"
    gpu = _run(route, "causal", q, k, v, torch.device("cuda"), torch.bfloat16)
    cpu = _run(SdpaRoute("cpu_lse_merge"), "causal", q, k, v, torch.device("cpu"), torch.float32)
    for name, got, want in zip(("out", "dq", "dk", "dv"), gpu, cpu):
        torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2, msg=f"cudnn {name}")
