"""tools/kernel_names.py: attention kernel families from name lists, device kernels (in the form the
CUDA profiler names them) and aten ops (the CPU twin, recorded here by the CPU profiler)."""

from __future__ import annotations

import pytest
import torch

from tsp_trainer.tools.kernel_names import attention_kernel_family, classify_names, profiled_names

# names in the form torch.profiler gives them (demangled kernel names, written from the kernels'
# sources and FlashAttention's naming; template arguments shortened): no GPU has recorded these
RECORDED = {
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, "
    "cutlass::bfloat16_t>, false, true, false, false, false, true, false, false>(Flash_fwd_params)": "fa2",
    "void pytorch_flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4, false, "
    "false, cutlass::bfloat16_t>, true, false, false, false, true, false, true>(Flash_fwd_params)": "fa2_splitkv",
    "void pytorch_flash::flash_fwd_splitkv_combine_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4>, "
    "4, 1, true>(Flash_fwd_params)": "fa2_splitkv",
    "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, "
    "64, 128, 8>, true, false, false, false, false, false>(Flash_bwd_params)": "fa2",
    "void pytorch_flash::flash_bwd_dot_do_o_kernel<true, Flash_bwd_kernel_traits<128>>(Flash_bwd_params)": "fa2",
    "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<flash::"
    "CollectiveMainloopFwdSm90<2, cute::tuple<cute::C<1>>>>>>(flash::FlashAttnFwdSm90::Params)": "fa3",
    "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnBwdSm90<flash::"
    "CollectiveMainloopBwdSm90<2>>>>(flash::FlashAttnBwdSm90::Params)": "fa3",
    "kernel_cutlass_kernel_flash_attncuteflash_fwd_sm100FlashAttentionForwardSm100_object_at__"
    "tensor0000o11101213_0": "fa4",
    "flash_fwd_sm90_bf16_head_dim128_tile128x128_causal_kernel_cutlass_kernel_flash_attncuteflash_fwd"
    "FlashAttentionForwardSm90_object_at__0": "fa4",
    "cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128_4x1x1_kernel0_0": "cudnn",
    "fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<"
    "cutlass::bfloat16_t, cutlass::arch::Sm80, true, 64, 128, 128, true, true>::Params)": "efficient",
    "fmha_cutlassB_bf16_aligned_128x64_k128_sm80(PyTorchMemEffAttention::AttentionBackwardKernel)": "efficient",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "cpu_flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": "cpu_flash",
    "aten::_flash_attention_forward": "flash",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_attention_math": "math",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": None,
    "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn": None,
    "aten::mm": None,
}


@pytest.mark.parametrize("name, family", RECORDED.items(), ids=[str(f) for f in RECORDED.values()])
def test_each_recorded_name_has_its_family(name, family):
    assert attention_kernel_family(name) == family


def test_split_kv_is_told_from_the_standard_flash_forward():
    names = [n for n, f in RECORDED.items() if f in ("fa2", "fa2_splitkv")] * 2
    got = classify_names(names + ["aten::mm"])
    assert got["families"] == {"fa2": 6, "fa2_splitkv": 4}
    assert sum(got["kernels"].values()) == 10 and "aten::mm" not in got["kernels"]


def test_cpu_profile_names_the_cpu_flash_op():
    q = torch.randn(1, 2, 16, 8, requires_grad=True)

    def step():
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()

    got = classify_names(profiled_names(step, torch.device("cpu")))
    assert got["families"] == {"cpu_flash": 2}      # the forward op and its backward
