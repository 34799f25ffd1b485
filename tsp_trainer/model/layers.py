"""Decoder layers: RMSNorm, RoPE, GQA causal attention (torch SDPA), SwiGLU gated MLP.

Conventions: activations are [B, T, h]; heads are split with view(B, T, -1, head_dim) so the same
code runs on a full model or on any contiguous head shard (TSP and the TP baselines reuse it).
Weights follow nn.Linear: [out_features, in_features], y = x @ W.T. RoPE uses Hugging Face's
rotate_half convention so weights export to transformers' LlamaForCausalLM unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from tsp_trainer.config import ModelConfig
from tsp_trainer.model.attention_route import CPU_MASK_QUERY_BLOCK, SdpaRoute, sdpa_route  # noqa: F401


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


@dataclass(frozen=True)
class PositionRuns:
    """Global positions of the tokens in hand as runs of consecutive positions, in token order:
    ((first position, length), ...); e.g. rank p's two zigzag chunks. Host integers, fixed once per
    batch layout, so attention never reads positions back from the device (a host sync per call)."""

    runs: tuple[tuple[int, int], ...]

    @classmethod
    def contiguous(cls, length: int, first: int = 0) -> "PositionRuns":
        return cls(((first, length),))

    @classmethod
    def of(cls, positions: torch.Tensor) -> "PositionRuns":
        """Runs of a positions tensor [T] (reads it: one host sync if it lives on a GPU)."""
        runs, pos = [], positions.tolist()
        for i, p in enumerate(pos):
            if runs and p == runs[-1][0] + runs[-1][1]:
                runs[-1][1] += 1
            else:
                runs.append([p, 1])
        return cls(tuple((first, n) for first, n in runs))

    def __len__(self) -> int:
        return sum(n for _, n in self.runs)

    def tensor(self, device=None) -> torch.Tensor:
        """Positions [T] built on `device` from the runs (no host-to-device copy)."""
        return torch.cat([torch.arange(first, first + n, device=device) for first, n in self.runs])

    def query_runs(self) -> tuple[tuple[int, int, int], ...]:
        """(start, stop, first position) of each run, as token-index ranges."""
        out, start = [], 0
        for first, n in self.runs:
            out.append((start, start + n, first))
            start += n
        return tuple(out)


@dataclass
class Rotary:
    """Global positions [T] of the tokens in hand, their RoPE tables cos, sin [T, head_dim], and
    the positions as runs (host ints, for attention's causal structure). A sequence-parallel caller
    passes the positions of its own slice (e.g. two zigzag chunks)."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    runs: tuple[tuple[int, int, int], ...] = ()     # (start, stop, first position) per run

    @classmethod
    def build(cls, positions: "PositionRuns | torch.Tensor", head_dim: int, theta: float,
              device=None) -> "Rotary":
        """From runs (no host sync; the tables are built on `device`) or a positions tensor."""
        if isinstance(positions, torch.Tensor):
            runs = PositionRuns.of(positions)
            tensor = positions if device is None else positions.to(device)
        else:
            runs, tensor = positions, positions.tensor(device)
        cos, sin = rope_cos_sin(tensor, head_dim, theta)
        return cls(tensor, cos, sin, runs.query_runs())


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [T, head_dim] for integer positions [T] (global token positions)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                             device=positions.device) / head_dim))
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]      # [T, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)                                # [T, d]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, heads, d]; cos/sin: [T, d] (fp32 tables, applied in x's dtype as HF does)."""
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return x * cos + _rotate_half(x) * sin


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   q_runs: tuple[tuple[int, int, int], ...] | None = None,
                   route: SdpaRoute | None = None) -> torch.Tensor:
    """Causal attention. q: [B, Tq, Hq, d]; k, v: [B, Tk, Hkv, d] in logical order (key j has
    position j). Returns [B, Tq, Hq * d].

    q_runs=None means the queries are the keys (Tq == Tk): plain causal SDPA. Otherwise q_runs
    holds (start, stop, first position) of each contiguous run of query positions (zigzag chunks,
    host ints from Rotary.runs; a positions tensor [Tq] is accepted and read once): the queries of
    a run see keys 0..first+(i-start), attended against that key prefix with a bottom-right
    aligned causal mask. `route` (default: `sdpa_route` of the inputs' device, dtype and shape)
    makes the SDPA calls: a fused kernel with torch's lower-right CausalBias on CUDA (no mask in
    memory), a boolean mask per block of queries on CPU (model/attention_route.py).
    """
    if isinstance(q_runs, torch.Tensor):              # positions [Tq]: read once (a host sync)
        q_runs = PositionRuns.of(q_runs).query_runs()
    b, tq, hq, d = q.shape
    gqa = hq != k.shape[2]
    route = route or sdpa_route(q.device.type, q.dtype, gqa=gqa, head_dim=d)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)   # [B, H, T, d]
    if route.expand_kv and gqa:          # [B, Hkv, T, d] -> [B, Hq, T, d]: the kernel takes no GQA
        kt, vt = (t.repeat_interleave(hq // t.shape[1], dim=1) for t in (kt, vt))
        gqa = False
    with route.kernels(q.device.type):
        if q_runs is None:
            out = route.causal(qt, kt, vt, gqa=gqa)
        else:
            out = torch.cat([route.prefix(qt[:, :, start:stop], kt, vt, first, gqa=gqa)
                             for start, stop, first in q_runs], dim=2)
    return out.transpose(1, 2).reshape(b, tq, hq * d)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.head_dim = d
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)

    def forward(self, x: torch.Tensor, rope: Rotary) -> torch.Tensor:
        b, t, _ = x.shape
        q = apply_rope(self.q_proj(x).view(b, t, -1, self.head_dim), rope.cos, rope.sin)
        k = apply_rope(self.k_proj(x).view(b, t, -1, self.head_dim), rope.cos, rope.sin)
        v = self.v_proj(x).view(b, t, -1, self.head_dim)
        return self.o_proj(attention_core(q, k, v))


def gated_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
              w_down: torch.Tensor) -> torch.Tensor:
    """SwiGLU: (silu(x W_gate^T) * (x W_up^T)) W_down^T. Works on any block of the intermediate
    dim: the sum over blocks of this function is the full MLP (TSP's ring relies on it)."""
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


class GatedMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, inter = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gated_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
