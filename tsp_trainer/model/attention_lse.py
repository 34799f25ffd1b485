"""Bottom-right causal attention on CPU without masked-out work: the key prefix and the diagonal
block computed apart and merged by log-sum-exp.

A zigzag chunk of n queries at first..first+n-1 sees every key of the prefix 0..first-1 (no mask)
and its diagonal block causally (`is_causal`); a boolean mask over the whole rectangle would make
CPU SDPA compute every masked-out score too, about twice the work for the last chunk.

    out = w_p out_p + w_d out_d,   w_x = exp(lse_x - lse),   lse = logaddexp(lse_p, lse_d)

Both parts run torch's CPU flash kernel, which returns the log-sum-exp. Backward runs the kernel's
backward per part with the merged output and lse, which gives each part's exact dK, dV (the
identity ring-flash-attention relies on), key block by key block into one buffer.
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
