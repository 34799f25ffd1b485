"""Decoder layers: RMSNorm, GQA causal attention (torch SDPA), SwiGLU gated MLP; RoPE is in rope.py.

Conventions: activations are [B, T, h]; heads are split with view(B, T, -1, head_dim) so the same
code runs on a full model or on any contiguous head shard (TSP and the TP baselines reuse it).
Weights follow nn.Linear: [out_features, in_features], y = x @ W.T (+ b). RoPE uses Hugging Face's
rotate_half convention so weights export to transformers' Llama / Mistral / Qwen2 unchanged.
Biases are data (ModelConfig.qkv_bias / o_bias / mlp_bias): an nn.Linear gets one or not.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from tsp_trainer.config import ModelConfig
from tsp_trainer.model.rope import Rotary, apply_rope, rope_cos_sin  # noqa: F401  (re-exported)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        # `weight` lets a parallel wrapper pass the same parameter through an autograd function
        # (e.g. one that sums its gradient over a group) without changing this math.
        w = self.weight if weight is None else weight
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * w


# Queries per SDPA call when a query slice needs a bottom-right causal mask on CPU: the mask (and
# the float copy SDPA makes of it) is [block, keys], so blocking bounds it at block * S elements
# instead of (S / D) * S.
CPU_MASK_QUERY_BLOCK = 512


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   q_positions: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention. q: [B, Tq, Hq, d]; k, v: [B, Tk, Hkv, d] in logical order (key j has
    position j). Returns [B, Tq, Hq * d].

    q_positions=None means the queries are the keys (Tq == Tk): plain causal SDPA. Otherwise query i
    sees keys 0..q_positions[i]; the queries are processed per contiguous run of positions (zigzag
    chunks are such runs) against the key prefix they need, with a bottom-right aligned causal mask:
    torch's lower-right CausalBias on GPU (fused kernels, no mask in memory), a boolean mask per
    block of CPU_MASK_QUERY_BLOCK queries on CPU.
    """
    b, tq, hq, d = q.shape
    gqa = hq != k.shape[2]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)   # [B, H, T, d]
    if q_positions is None:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=gqa)
        return out.transpose(1, 2).reshape(b, tq, hq * d)
    step = tq if q.is_cuda else CPU_MASK_QUERY_BLOCK
    outs = []
    for start, stop in _contiguous_runs(q_positions):
        first = int(q_positions[start])
        for s in range(start, stop, step):
            e = min(stop, s + step)
            n_q, n_k = e - s, first + (e - start)      # keys 0 .. position of the block's last query
            outs.append(F.scaled_dot_product_attention(qt[:, :, s:e], kt[:, :, :n_k], vt[:, :, :n_k],
                                                       attn_mask=_lower_right(n_q, n_k, q.device),
                                                       enable_gqa=gqa))
    out = torch.cat(outs, dim=2)
    return out.transpose(1, 2).reshape(b, tq, hq * d)


def _lower_right(n_q: int, n_k: int, device: torch.device):
    """Query i (the i-th of the last n_q positions) sees keys 0 .. n_k - n_q + i."""
    if device.type == "cuda":
        return causal_lower_right(n_q, n_k)
    return torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril(diagonal=n_k - n_q)


def _contiguous_runs(positions: torch.Tensor) -> list[tuple[int, int]]:
    """[(start, stop)] index ranges over which positions increase by exactly one."""
    pos = positions.tolist()
    runs, start = [], 0
    for i in range(1, len(pos) + 1):
        if i == len(pos) or pos[i] != pos[i - 1] + 1:
            runs.append((start, i))
            start = i
    return runs


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.head_dim = d
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=cfg.o_bias)

    def forward(self, x: torch.Tensor, rope: Rotary) -> torch.Tensor:
        b, t, _ = x.shape
        q = apply_rope(self.q_proj(x).view(b, t, -1, self.head_dim), rope.cos, rope.sin)
        k = apply_rope(self.k_proj(x).view(b, t, -1, self.head_dim), rope.cos, rope.sin)
        v = self.v_proj(x).view(b, t, -1, self.head_dim)
        return self.o_proj(attention_core(q, k, v))


def gated_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
              b_gate: torch.Tensor | None = None, b_up: torch.Tensor | None = None,
              b_down: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU: (silu(x W_gate^T + b_gate) * (x W_up^T + b_up)) W_down^T + b_down. Works on any
    block of the intermediate dim (with the same block of the gate/up biases) and b_down=None: the
    sum over blocks is then the full MLP less down_proj's bias, which the caller adds once (TSP's
    ring and the row-parallel baselines rely on it)."""
    return F.linear(F.silu(F.linear(x, w_gate, b_gate)) * F.linear(x, w_up, b_up), w_down, b_down)


class GatedMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, inter = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, inter, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(h, inter, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(inter, h, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gated_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight,
                         self.gate_proj.bias, self.up_proj.bias, self.down_proj.bias)
