"""The CUDA-only paths on one GPU, against their CPU counterparts on the same inputs:

* the fused attention routes (model/attention_route.py: flash for bf16, memory-efficient with K/V
  expanded under GQA for fp32, restricted so a fall to the math kernel is an error), plain causal,
  zigzag chunks with the bottom-right prefix alignment, and document masking's varlen call, forward
  and backward, against the CPU log-sum-exp route;
* pinned host staging of async checkpoints (checkpoint/background.py HostStaging);
* activation offload to pinned host memory on a side stream (model/offload.py) against the same
  model without offload, and with nesting's regained inputs on the host or fetched on demand
  against per-block checkpointing;
* the CUDA allocator's peak memory (observability/metrics.py peak_memory_bytes);
* RMSNorm on CUDA through torch's fused kernel (model/rms_norm.py) against the chunked function.

Run with `python -m pytest -m gpu` (the default options deselect the gpu marker); without a CUDA
device every test here is skipped with the reason."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from tests.distributed.tsp_cases import init_model, make_batch
from tsp_trainer.checkpoint.background import HostStaging
from tsp_trainer.config import model_config
from tsp_trainer.model import Transformer, attention_core
from tsp_trainer.model.attention_route import sdpa_route
from tsp_trainer.model.documents import Documents
from tsp_trainer.model.offload import ActivationOffload
from tsp_trainer.model.rms_norm import RmsNormFn, rms_norm
from tsp_trainer.observability import peak_memory_bytes, reset_peak_memory
from tsp_trainer.parallel import zigzag

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA device (torch.cuda.is_available() is False)")]

CUDA = "cuda"
# relative error in the Frobenius norm, GPU kernel vs the fp32 CPU route on the same values: a
# wrong mask or alignment gives O(1); bf16 rounding of the output and gradients stays near 1e-3
REL_ERR = {torch.bfloat16: 2e-2, torch.float32: 2e-5}
S, DEGREE, HEAD_DIM = 512, 4, 64
HEADS = {"gqa": (8, 2), "mha": (4, 4)}


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    return ((a - b).norm() / b.norm()).item()


def _qkv(hq: int, hkv: int, tq: int, dtype: torch.dtype, seed: int = 0):
    """q [2, tq, hq, d], k, v [2, S, hkv, d] on the host, rounded to `dtype` (the GPU's inputs)."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, t, h, HEAD_DIM, generator=gen).to(dtype)
                 for t, h in ((tq, hq), (S, hkv), (S, hkv)))


def _forward_backward(q, k, v, device, dtype, grad_out, **kwargs):
    """attention_core on `device` in `dtype` (the route it picks there); output and dq, dk, dv."""
    leaves = [t.detach().to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v)]
    out = attention_core(*leaves, **kwargs)
    grads = torch.autograd.grad(out, leaves, grad_out.to(device=device, dtype=dtype))
    return out, grads


def _compare_with_cpu(q, k, v, dtype, **kwargs):
    """The GPU route in `dtype` against the CPU log-sum-exp route in fp32 on the same values."""
    torch.manual_seed(1)
    grad_out = torch.randn(q.shape[0], q.shape[1], q.shape[2] * q.shape[3])
    gpu, gpu_grads = _forward_backward(q, k, v, CUDA, dtype, grad_out, **kwargs)
    cpu, cpu_grads = _forward_backward(q, k, v, "cpu", torch.float32, grad_out, **kwargs)
    assert gpu.dtype == dtype and gpu.is_cuda
    errors = {"out": _rel_err(gpu, cpu)} | {f"d{n}": _rel_err(g, c)
                                            for n, g, c in zip("qkv", gpu_grads, cpu_grads)}
    assert max(errors.values()) < REL_ERR[dtype], errors


@pytest.mark.parametrize("dtype,kernel", [(torch.bfloat16, "flash"), (torch.float32, "efficient")],
                         ids=["bf16-flash", "fp32-efficient"])
@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
def test_fused_causal_attention_matches_the_cpu_route(dtype, kernel, heads):
    """Square causal attention (the queries are the keys). CPU twin of the route decision:
    tests/unit/test_attention_route.py::test_cuda_route_is_a_fused_kernel."""
    hq, hkv = HEADS[heads]
    assert sdpa_route("cuda", dtype, gqa=hq != hkv, head_dim=HEAD_DIM).kernel == kernel
    _compare_with_cpu(*_qkv(hq, hkv, S, dtype), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
@pytest.mark.parametrize("rank", [0, 1, DEGREE - 1])
def test_fused_zigzag_prefix_attention_matches_the_cpu_route(dtype, heads, rank):
    """A zigzag rank's two chunks of S / 2D queries against the whole key sequence, each run
    aligned bottom-right to its key prefix (torch's lower-right CausalBias inside the fused
    kernel). CPU twin: tests/unit/test_attention_route.py::
    test_cuda_route_run_on_cpu_matches_the_causal_reference (the CUDA route's math on CPU)."""
    hq, hkv = HEADS[heads]
    runs = zigzag.zigzag_runs(S, rank, DEGREE)
    q, k, v = _qkv(hq, hkv, S // DEGREE, dtype, seed=rank)
    _compare_with_cpu(q, k, v, dtype, q_runs=runs.query_runs())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("rank,degree", [(0, 1), (1, DEGREE)])
def test_varlen_document_attention_matches_the_cpu_route(dtype, rank, degree):
    """Document masking: each row's segments in one varlen fused call (flash's cu_seqlens mode for
    bf16, memory-efficient's for fp32, GQA) against one CPU call per segment; documents shorter
    than a chunk, spanning chunks, and one token long. CPU twin of the packing:
    tests/unit/test_document_masking.py::test_varlen_route_cpu_twin."""
    hq, hkv = HEADS["gqa"]
    runs = zigzag.zigzag_runs(S, rank, degree)
    docs = Documents.from_lengths([[37, 200, 1, 274], [S]])
    q, k, v = _qkv(hq, hkv, S // degree, dtype, seed=3)
    _compare_with_cpu(q, k, v, dtype, q_runs=runs.query_runs(), documents=docs)


# ---- pinned host staging of an async checkpoint ----------------------------------------------

def test_host_staging_copies_gpu_tensors_into_reused_pinned_buffers():
    """A GPU tensor (live or fresh) is copied with a non-blocking copy into a pinned host buffer;
    work queued on the stream after the snapshot does not reach the copy; `complete()` (the writer
    thread) waits for the copies; the next save reuses the buffer. CPU twin:
    tests/unit/test_checkpoint_writer.py::test_gpu_staging_path_pins_copies_async_and_syncs_once."""
    staging = HostStaging()
    live = torch.randn(64 * 2**20 // 4, device=CUDA)            # 64 MiB: the copy takes a while
    fresh = torch.arange(1000.0, device=CUDA)
    expected = live.cpu(), fresh.cpu()
    bufs = staging("w", live, "live"), staging("m", fresh, "fresh")
    staging.staged()
    live.mul_(0)                                                  # the next step changes the weights
    assert not staging.copied.is_set()
    staging.complete()
    assert staging.copied.is_set()
    for buf, want in zip(bufs, expected):
        assert buf.device.type == "cpu" and buf.is_pinned()
        assert torch.equal(buf, want)
    assert staging("w", live, "live").data_ptr() == bufs[0].data_ptr()
    staging.staged()
    staging.complete()
    assert torch.equal(bufs[0], torch.zeros_like(bufs[0]))


# ---- activation offload ----------------------------------------------------------------------

def _checkpointed(block, x, rope):
    return checkpoint(block, x, rope, use_reentrant=False)


@pytest.mark.parametrize("ac", [False, True], ids=["plain", "checkpointed"])
def test_activation_offload_on_cuda_matches_no_offload(ac):
    """Saved tensors go to pinned host memory on a side stream and come back one block ahead: the
    loss and every gradient equal the run without offload (fp32; the copies are exact, the
    kernels' own run-to-run variation is the tolerance), the host holds every block's saved
    tensors after the forward and none after the backward. CPU twin (the same code path with host
    copies, bit-identical): tests/distributed/test_offload.py."""
    cfg = model_config("tiny", num_heads=8, num_kv_heads=4)
    ids, labels = make_batch(cfg, 2, 256)
    ids, labels = ids.to(CUDA), labels.to(CUDA)
    model = Transformer(cfg)
    init_model(model, 7)
    model.to(CUDA)
    inner = _checkpointed if ac else None
    runs = {}
    for name, wrapper in (("plain", inner), ("offload", ActivationOffload(inner))):
        model.block_wrapper = wrapper
        model.zero_grad(set_to_none=True)
        loss = model.loss(ids, labels)
        if name == "offload":
            torch.cuda.synchronize()
            host = [t for s in wrapper._stores.values() for t in s.host if t is not None]
            assert host and all(t.device.type == "cpu" and t.is_pinned() for t in host)
            assert wrapper.host_bytes >= cfg.num_layers * ids.numel() * cfg.hidden_size * 4
        loss.backward()
        torch.cuda.synchronize()
        runs[name] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()})
        if name == "offload":
            assert wrapper.host_bytes == 0
    (plain_loss, plain_grads), (off_loss, off_grads) = runs["plain"], runs["offload"]
    assert off_loss == pytest.approx(plain_loss, rel=1e-6)
    for n, g in plain_grads.items():
        torch.testing.assert_close(off_grads[n], g, rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("k,prefetch", [(1, False), (3, True), (3, False)],
                         ids=["on-demand", "nested", "nested-on-demand"])
def test_nested_offload_and_fetching_on_demand_on_cuda_match_per_block_offload(k, prefetch):
    """Nested checkpointing under the offload (the regained inner inputs in pinned host memory,
    copied on the side stream and fetched back for their blocks) and the offload fetching on
    demand (train.offload_prefetch=false): the loss and every gradient equal per-block
    checkpointing's with the prefetching offload, the host is empty after the backward; fetching on
    demand does not raise the device peak, and nesting raises it by less than one block input (the two
    inner inputs a segment of 3 regains are not on the device). CPU twins, bit-identical on 1, 2
    and 4 ranks: tests/distributed/test_nested_checkpoint.py, test_offload.py; the device count on
    CPU: test_offload.py."""
    from tsp_trainer.model.activation_checkpoint import wrap_blocks

    cfg = model_config("tiny", num_layers=5, num_heads=8, num_kv_heads=4)
    ids, labels = make_batch(cfg, 2, 1024)
    ids, labels = ids.to(CUDA), labels.to(CUDA)
    model = Transformer(cfg)
    init_model(model, 7)
    model.to(CUDA)
    runs = {}
    for name, segment, ahead in (("reference", 1, True), ("variant", k, prefetch)):
        wrap_blocks(model, checkpointing=True, offload=True, segment_blocks=segment, prefetch=ahead)
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        reset_peak_memory(torch.device(CUDA))
        loss = model.loss(ids, labels)
        loss.backward()
        torch.cuda.synchronize()
        assert model.block_wrapper.host_bytes == 0 and model.block_wrapper.fetched_bytes == 0
        runs[name] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()},
                      peak_memory_bytes(torch.device(CUDA)))
    (ref_loss, ref_grads, ref_peak), (loss, grads, peak) = runs["reference"], runs["variant"]
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    for n, g in ref_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-6, msg=n)
    block_input = ids.numel() * cfg.hidden_size * 4
    # the loss's logits set this tiny model's peak: fetching on demand cannot raise it (the device
    # count of one block input less is exact on CPU), nesting adds less than a block input
    assert peak <= ref_peak if not prefetch else peak < ref_peak + block_input


# ---- peak memory -----------------------------------------------------------------------------

def test_peak_memory_bytes_on_cuda_moves_by_an_allocated_tensor():
    """On CUDA the peak is the allocator's max_memory_allocated since reset_peak_memory: a
    256 MiB tensor raises it by exactly its size. CPU counterpart (max RSS):
    tests/integration/test_console_scripts.py::test_peak_memory_bytes_cpu_moves_by_a_written_tensor."""
    torch.cuda.synchronize()
    reset_peak_memory(CUDA)
    before = torch.cuda.memory_allocated()
    assert peak_memory_bytes(CUDA) == before
    x = torch.empty(256 * 2**20, dtype=torch.uint8, device=CUDA)
    assert peak_memory_bytes(CUDA) == before + x.numel()
    del x
    assert peak_memory_bytes(CUDA) == before + 256 * 2**20     # a peak, not the current use


# ---- RMSNorm ---------------------------------------------------------------------------------

def _norm_step(fn, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor):
    """Output, dx, dw of fn(x, w) and the peak bytes above the start, on fresh leaves."""
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    y = fn(x, w, 1e-5)
    grads = torch.autograd.grad(y, (x, w), dy)
    torch.cuda.synchronize()
    return y.detach(), grads, torch.cuda.max_memory_allocated() - base


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_rms_norm_on_cuda_is_the_fused_kernel_and_matches_the_chunked_function(dtype):
    """rms_norm on CUDA is torch's fused kernel (not RmsNormFn's chunk loop): the output, dx and dw
    equal the chunked function's on the same GPU tensors to the dtype's rounding, and its forward +
    backward peak is lower (no fp32 chunk temporaries)."""
    gen = torch.Generator(device=CUDA).manual_seed(0)
    x = torch.randn(8192, 4096, device=CUDA, dtype=dtype, generator=gen)
    w = 1 + 0.1 * torch.randn(4096, device=CUDA, dtype=dtype, generator=gen)
    dy = torch.randn(8192, 4096, device=CUDA, dtype=dtype, generator=gen)
    assert "RmsNormFn" not in type(rms_norm(x.requires_grad_(), w, 1e-5).grad_fn).__name__
    fused, fused_grads, fused_peak = _norm_step(rms_norm, x, w, dy)
    chunked, chunked_grads, chunked_peak = _norm_step(RmsNormFn.apply, x, w, dy)
    assert _rel_err(fused, chunked) < REL_ERR[dtype]
    for name, g, r in zip(("dx", "dw"), fused_grads, chunked_grads):
        assert _rel_err(g, r) < REL_ERR[dtype], name
    assert fused_peak < chunked_peak, (fused_peak, chunked_peak)
