"""Decoder layers: RMSNorm, GQA causal attention (torch SDPA), SwiGLU gated MLP; RoPE is in rope.py.

Conventions: activations are [B, T, h]; heads are split with view(B, T, -1, head_dim) so the same
code runs on a full model or on any contiguous head shard (TSP and the TP baselines reuse it).
Weights follow nn.Linear: [out_features, in_features], y = x @ W.T (+ b). RoPE uses Hugging Face's
rotate_half convention so weights export to transformers' Llama / Mistral / Qwen2 / Qwen3 unchanged.
Qwen3's q_norm / k_norm (ModelConfig.qk_norm) are RMSNorms over each head's head_dim channels.
Biases are data (ModelConfig.qkv_bias / o_bias / mlp_bias): an nn.Linear gets one or not.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tsp_trainer.config import ModelConfig
from tsp_trainer.model.documents import Documents
from tsp_trainer.model.attention_route import CPU_MASK_QUERY_BLOCK, SdpaRoute, sdpa_route  # noqa: F401
from tsp_trainer.model.rms_norm import rms_norm
from tsp_trainer.model.rope import PositionRuns, Rotary, apply_rope, rope_cos_sin  # noqa: F401  (re-exported)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, *, device: torch.device | str | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device))

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        # `weight` lets a parallel wrapper pass the same parameter through an autograd function
        # (e.g. one that sums its gradient over a group) without changing this math.
        # The math is RmsNormFn's (model/rms_norm.py): it saves x and rstd only and its backward
        # holds no full-size fp32 temporaries.
        return rms_norm(x, self.weight if weight is None else weight, self.eps)


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   q_runs: tuple[tuple[int, int, int], ...] | None = None,
                   route: SdpaRoute | None = None, documents: Documents | None = None,
                   kernel: str = "fa2", gqa_path: str = "native") -> torch.Tensor:
    """Causal attention. q: [B, Tq, Hq, d]; k, v: [B, Tk, Hkv, d] in logical order (key j has
    position j). Returns [B, Tq, Hq * d].

    q_runs=None means the queries are the keys (Tq == Tk): plain causal SDPA. Otherwise q_runs
    holds (start, stop, first position) of each contiguous run of query positions (zigzag chunks,
    host ints from Rotary.runs; a positions tensor [Tq] is accepted and read once): the queries of
    a run see keys 0..first+(i-start), attended against that key prefix with a bottom-right
    aligned causal mask. `route` (default: `sdpa_route` of the inputs' device, dtype and shape,
    under the run's attention `kernel` and GQA path `gqa_path`)
    makes the SDPA calls: a fused kernel with torch's lower-right CausalBias on CUDA (no mask in
    memory), a boolean mask per block of queries on CPU (model/attention_route.py). A route with
    gqa_native (CUDA flash under GQA, gqa_path "native") runs model/attention_gqa.py instead:
    kernel calls with the KV heads, no K/V or dK/dV per query head.

    documents (document masking): each row's queries see only the keys of their own document
    (row b's starts in documents.starts[b]); the runs are cut into per-document segments
    (model/documents.py), so the work follows the documents' lengths. The cut is the batch's
    plan (documents.plan), made at the first call and reused by every later one.
    """
    if isinstance(q_runs, torch.Tensor):              # positions [Tq]: read once (a host sync)
        q_runs = PositionRuns.of(q_runs).query_runs()
    b, tq, hq, d = q.shape
    gqa = hq != k.shape[2]
    route = route or sdpa_route(q.device.type, q.dtype, gqa=gqa, head_dim=d, kernel=kernel, gqa_path=gqa_path)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)   # [B, H, T, d]
    if route.gqa_native and gqa:         # K/V and dK/dV at the KV heads (model/attention_gqa.py)
        if documents is not None and len(documents.starts) != b:
            raise ValueError(f"document boundaries for {len(documents.starts)} rows, batch has {b}")
        out = route.grouped(qt, kt, vt, q_runs, documents)
        return out.transpose(1, 2).reshape(b, tq, hq * d)
    if route.expand_kv and gqa:          # [B, Hkv, T, d] -> [B, Hq, T, d]: the kernel takes no GQA
        kt, vt = (t.repeat_interleave(hq // t.shape[1], dim=1) for t in (kt, vt))
        gqa = False
    with route.kernels(q.device.type):
        if documents is not None:
            runs = q_runs if q_runs is not None else ((0, tq, 0),)
            if len(documents.starts) != b:
                raise ValueError(f"document boundaries for {len(documents.starts)} rows, batch has {b}")
            out = torch.cat([route.documents(qt[i:i + 1], kt[i:i + 1], vt[i:i + 1], row, gqa=gqa)
                             for i, row in enumerate(documents.plan(runs))], dim=0)
        elif q_runs is None:
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
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=cfg.o_bias)
        if cfg.qk_norm:     # Qwen3: RMSNorm over each head's d channels, one weight [d] for all heads
            self.q_norm = RMSNorm(d, cfg.norm_eps)
            self.k_norm = RMSNorm(d, cfg.norm_eps)

    def forward(self, x: torch.Tensor, rope: Rotary) -> torch.Tensor:
        b, t, _ = x.shape
        q, k = self.q_proj(x).view(b, t, -1, self.head_dim), self.k_proj(x).view(b, t, -1, self.head_dim)
        if hasattr(self, "q_norm"):                       # before RoPE, as transformers' Qwen3
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, rope.cos, rope.sin)
        k = apply_rope(k, rope.cos, rope.sin)
        v = self.v_proj(x).view(b, t, -1, self.head_dim)
        # the queries are the keys; with document masking, at the positions of rope.runs
        runs = rope.runs if rope.documents is not None else None
        return self.o_proj(attention_core(q, k, v, runs, documents=rope.documents,
                                          kernel=rope.attention_kernel, gqa_path=rope.attention_gqa))


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
