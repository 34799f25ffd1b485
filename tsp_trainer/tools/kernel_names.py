"""Which attention kernel ran, from the names a profiled step recorded.

On CUDA the names are those of the device kernels (torch.profiler, ProfilerActivity.CUDA: events
whose device type is CUDA), so what is reported is what the GPU executed, not which aten op was
asked for: an aten SDPA op can launch FA2's standard or split-KV forward, FA3 or FA4 (when
activated in torch's dispatcher), cuDNN's or the memory-efficient kernel. On CPU the same
classification reads the aten op names (the CPU twin of the GPU acceptance run).

Families (`attention_kernel_family`), by the substrings of the kernels' names:

  fa2_splitkv   FlashAttention-2's split-KV forward and its combine (flash_fwd_splitkv_kernel,
                flash_fwd_splitkv_combine_kernel): chosen by FA2's heuristic when batch x heads x
                query blocks fills too few SMs; it allocates fp32 partial outputs per split
  fa2           FlashAttention-2 (torch's vendored copy): flash_fwd_kernel, flash_bwd_* kernels
  fa3           FlashAttention-3 (flash::FlashAttnFwdSm90, FlashAttnBwdSm90, their pre/post and
                combine kernels)
  fa4           FlashAttention-4 (CuTe DSL: names holding flash_attncute or
                FlashAttentionForwardSm90 / Sm100, FlashAttentionBackwardSm*)
  cudnn         cuDNN attention (kernels named cudnn*, and aten::_scaled_dot_product_cudnn_attention)
  efficient     memory-efficient attention (fmha_cutlassF / fmha_cutlassB, and the aten ops
                _efficient_attention_* / _scaled_dot_product_efficient_attention)
  flash         the aten flash ops (CPU names of a CUDA flash call: which flash kernel is unknown)
  cpu_flash     SDPA's CPU flash kernel (aten::_scaled_dot_product_flash_attention_for_cpu)
  math          SDPA's math fallback (aten::_scaled_dot_product_attention_math)
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:                   # torch is imported where a profile runs
    import torch

# (family, substrings of the lower-cased name); the first family with a match wins, so the more
# specific names come first (FA4's CuTe kernels also contain "flash_fwd", FA2's split-KV kernel
# contains "flash_fwd").
FAMILIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("fa4", ("flash_attncute", "flashattentionforwardsm", "flashattentionbackwardsm",
             "flashattentionforwardcombine")),
    ("fa3", ("flashattnfwdsm90", "flashattnbwdsm90", "flashattnfwdcombine", "flashattnbwdpreprocess",
             "flashattnbwdpostprocess", "flash_attn_3")),
    ("fa2_splitkv", ("flash_fwd_splitkv_kernel", "flash_fwd_splitkv_combine_kernel")),
    ("fa2", ("flash_fwd_kernel", "flash_bwd_dot_do_o_kernel", "flash_bwd_dq_dk_dv", "flash_bwd_convert_dq",
             "flash_bwd_convert_dkv", "flash_bwd_kernel")),
    ("cudnn", ("cudnn",)),
    ("efficient", ("fmha_cutlass", "efficient_attention", "_scaled_dot_product_efficient_attention")),
    ("cpu_flash", ("_scaled_dot_product_flash_attention_for_cpu",)),
    ("flash", ("_flash_attention_forward", "_flash_attention_backward",
               "_scaled_dot_product_flash_attention")),
    ("math", ("_scaled_dot_product_attention_math",)),
)


def attention_kernel_family(name: str) -> str | None:
    """The attention family of a kernel or op name (module docstring), None for anything else."""
    low = name.lower()
    for family, words in FAMILIES:
        if any(w in low for w in words):
            return family
    return None


def classify_names(names) -> dict:
    """{"kernels": {name: count} of the attention names, most frequent first, "families":
    {family: count}} for an iterable of recorded names (one entry per launch or call)."""
    kernels: Counter = Counter()
    families: Counter = Counter()
    for name in names:
        family = attention_kernel_family(name)
        if family is not None:
            kernels[name] += 1
            families[family] += 1
    return {"kernels": dict(kernels.most_common()), "families": dict(families.most_common())}


def profiled_names(fn, device: torch.device) -> list[str]:
    """Run fn() once under torch.profiler; the names of the device kernels it launched (CUDA) or of
    the CPU ops it ran (CPU), one per launch / call."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize(device)
    want = DeviceType.CUDA if cuda else DeviceType.CPU
    return [ev.name for ev in prof.events() if ev.device_type == want]
