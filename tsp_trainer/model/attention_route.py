"""Which SDPA kernel `attention_core` asks for, decided from (device, dtype, GQA, head_dim) alone.

A query run that needs a bottom-right causal mask (zigzag chunks: queries at positions
first..first+n-1 against keys 0..first+n-1) goes to torch's lower-right `CausalBias` on CUDA.
That bias reaches a fused kernel only when flash or memory-efficient attention accepts the
inputs; otherwise it materialises a dense [n_q, n_k] mask and runs the math kernel: ~4 GiB of
scores per head and call at 128K, out of memory (torch/nn/attention/bias.py, `_dispatch`). So on
CUDA the route names one fused kernel, `attention_core` restricts SDPA to it (a silent fall to the
math kernel becomes a loud "No available kernel"), and what no fused kernel takes is refused
before any process group exists, naming shape and dtype:

  bf16 / fp16, head_dim <= 256          flash (GQA native, lower-right causal, no mask)
  fp32, or head_dim > 256               memory-efficient, with K/V heads expanded to the query
                                        heads under GQA (the lower-right variant of the kernel is
                                        called without GQA support; expanding costs K/V x groups
                                        of transient memory, linear in the sequence)
  fp32 head_dim not a multiple of 4,    refused: neither fused kernel takes it
  half head_dim > 256 not a multiple of 8

On CPU the route is a boolean mask per block of CPU_MASK_QUERY_BLOCK queries (the validation
path; CPU SDPA has no lower-right bias without a mask). `attention_core` takes the route as given,
so a test runs the CUDA route's math on CPU tensors (tests/unit/test_attention_route.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

# Queries per SDPA call when a query slice needs a bottom-right causal mask on CPU: the mask (and
# the float copy SDPA makes of it) is [block, keys], so blocking bounds it at block * S elements
# instead of (S / D) * S.
CPU_MASK_QUERY_BLOCK = 512

FLASH_MAX_HEAD_DIM = 256
_HALF = (torch.bfloat16, torch.float16)


class UnsupportedAttentionError(ValueError):
    """No fused attention kernel takes these shapes and dtype on this device."""


@dataclass(frozen=True)
class SdpaRoute:
    """How `attention_core` calls SDPA on one device: the kernel, and the calls themselves."""

    kernel: str                 # "flash" | "efficient" (CUDA, fused, no mask) | "cpu_blocked_mask"
    expand_kv: bool = False     # repeat K/V heads to the query heads before the call
    query_block: int | None = None   # queries per call for the CPU mask path

    @property
    def lower_right_bias(self) -> bool:
        """Bottom-right causal runs use torch's CausalBias (no mask in memory)."""
        return self.kernel != "cpu_blocked_mask"

    def kernels(self, device_type: str):
        """Context restricting SDPA on CUDA to this route's kernel. A no-op on CPU, also for a
        CUDA route run on CPU tensors (the CPU twin in the tests: CPU has no such kernels)."""
        if self.kernel == "cpu_blocked_mask" or device_type != "cuda":
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}
        return sdpa_kernel([backend[self.kernel]])

    # The SDPA calls. q, k, v: [B, H, T, d] (K/V already expanded when expand_kv).
    def causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, gqa: bool) -> torch.Tensor:
        """Square causal attention (queries are the keys)."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    def prefix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, *,
               gqa: bool) -> torch.Tensor:
        """Queries [B, H, n, d] at positions first..first+n-1 against keys 0..first+n-1."""
        n = q.shape[2]
        if self.lower_right_bias:
            n_k = first + n
            return F.scaled_dot_product_attention(q, k[:, :, :n_k], v[:, :, :n_k],
                                                  attn_mask=causal_lower_right(n, n_k), enable_gqa=gqa)
        outs = []
        for s in range(0, n, self.query_block):
            e = min(n, s + self.query_block)
            n_k = first + e                    # keys 0 .. position of the block's last query
            mask = torch.ones(e - s, n_k, dtype=torch.bool, device=q.device).tril(diagonal=n_k - (e - s))
            outs.append(F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, :n_k], v[:, :, :n_k],
                                                       attn_mask=mask, enable_gqa=gqa))
        return torch.cat(outs, dim=2)


def sdpa_route(device_type: str, dtype: torch.dtype, *, gqa: bool, head_dim: int) -> SdpaRoute:
    """The kernel `attention_core` uses for these inputs (pure; see the module docstring)."""
    if device_type != "cuda":
        return SdpaRoute("cpu_blocked_mask", query_block=CPU_MASK_QUERY_BLOCK)
    if dtype in _HALF and head_dim <= FLASH_MAX_HEAD_DIM:
        return SdpaRoute("flash")          # torch pads head_dim to a multiple of 8 for flash
    alignment = 8 if dtype in _HALF else 4
    if dtype in (*_HALF, torch.float32) and head_dim % alignment == 0:
        return SdpaRoute("efficient", expand_kv=gqa)
    raise UnsupportedAttentionError(
        f"attention with head_dim={head_dim} in {str(dtype).removeprefix('torch.')} on CUDA: no "
        f"fused kernel takes it (flash: bf16/fp16 and head_dim <= {FLASH_MAX_HEAD_DIM}; "
        f"memory-efficient: head_dim a multiple of {alignment}), and the math "
        f"fallback needs a dense [queries, keys] score matrix per head (out of memory at long "
        f"context); change model.hidden_size / model.num_heads or train.dtype")


def check_cuda_attention(*, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> SdpaRoute:
    """The CUDA route of a model, or UnsupportedAttentionError (the Trainer calls this before it
    starts any process group)."""
    return sdpa_route("cuda", dtype, gqa=num_heads != num_kv_heads, head_dim=head_dim)
