"""Bottom-right causal attention without masked waste on CPU: the key prefix and the diagonal
block computed apart and merged by log-sum-exp.

A zigzag chunk of n queries at positions first..first+n-1 sees keys 0..first+n-1: every query sees
the whole prefix 0..first-1 (no mask), and the diagonal block first..first+n-1 causally (a square
`is_causal` call, whose kernel skips the blocks above the diagonal). With a boolean mask over the
[n, first+n] rectangle instead, CPU SDPA computes every masked-out score too: for the last chunk
(first = S - n, n = S / 2D) that is about twice the causal work. Documents (model/documents.py)
use the same call with their own key range.

    out = softmax([s_prefix, s_diag]) [v_prefix; v_diag]
        = w_p out_p + w_d out_d,   w_x = exp(lse_x - lse),   lse = logaddexp(lse_p, lse_d)

Both parts run on torch's CPU flash kernel (`aten._scaled_dot_product_flash_attention_for_cpu`),
which returns the log-sum-exp [B, H, n] (fp32) and supports GQA (H a multiple of H_kv). Backward
runs the kernel's backward once per part with the *merged* output and log-sum-exp: the flash
backward rebuilds each part's probabilities as exp(s - lse) and uses rowsum(dO * O), both of the
whole softmax, so the two parts' dQ add up and their dK, dV are the exact gradients of their keys
(the identity ring-flash-attention relies on). That holds for any subset of keys, so backward
walks the prefix in blocks of n keys and writes each block's dK, dV into one preallocated buffer:
beside dK, dV only one block's gradients exist (as with SDPA's own backward). Saved: q, k, v
(views), the merged output and lse.
"""

from __future__ import annotations

import torch

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _merge(out_p: torch.Tensor, lse_p: torch.Tensor, out_d: torch.Tensor, lse_d: torch.Tensor):
    """Two partial softmax-attention results over disjoint keys -> the result over all keys.
    out_*: [B, H, n, d]; lse_*: [B, H, n] fp32."""
    lse = torch.logaddexp(lse_p, lse_d)
    w_p, w_d = (torch.exp(x - lse).unsqueeze(-1) for x in (lse_p, lse_d))
    out = (w_p * out_p.float() + w_d * out_d.float()).to(out_p.dtype)
    return out, lse


class PrefixCausalAttention(torch.autograd.Function):
    """q [B, H, n, d]; k, v [B, H_kv, n_k, d] with n_k > n -> [B, H, n, d], query i seeing keys
    0 .. n_k - n + i."""

    @staticmethod
    def forward(ctx, q, k, v):
        n_prefix = k.shape[2] - q.shape[2]
        out_p, lse_p = _FLASH(q, k[:, :, :n_prefix], v[:, :, :n_prefix])
        out_d, lse_d = _FLASH(q, k[:, :, n_prefix:], v[:, :, n_prefix:], is_causal=True)
        out, lse = _merge(out_p, lse_p, out_d, lse_d)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        n = q.shape[2]
        n_prefix = k.shape[2] - n
        dout = dout.contiguous()
        # dK, dV are written block by block into one buffer: the key blocks' gradients are exact
        # with the merged out/lse (any key subset is), so no prefix-sized partial gradient and
        # no concatenated copy exist next to it
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        dq, dk[:, :, n_prefix:], dv[:, :, n_prefix:] = _FLASH_BACKWARD(
            dout, q, k[:, :, n_prefix:], v[:, :, n_prefix:], out, lse, 0.0, True)
        for s in range(0, n_prefix, n):                   # the prefix in blocks of n keys
            e = min(n_prefix, s + n)
            dq_b, dk[:, :, s:e], dv[:, :, s:e] = _FLASH_BACKWARD(dout, q, k[:, :, s:e], v[:, :, s:e],
                                                                 out, lse, 0.0, False)
            dq += dq_b
        return dq, dk, dv


def prefix_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Bottom-right causal attention of q [B, H, n, d] against k, v [B, H_kv, n_k, d] (n_k >= n),
    merged by log-sum-exp (see the module docstring)."""
    if k.shape[2] == q.shape[2]:
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    return PrefixCausalAttention.apply(q, k, v)
