"""Rotary position embeddings: plain RoPE and its context-extension scalings (linear, llama3, yarn),
numerically identical to transformers' implementation (modeling_rope_utils.py and
LlamaRotaryEmbedding.forward in transformers 5.24: same fp32 operations in the same order; tests
compare the tables bit for bit).

The tables are built for any integer position tensor [T]: a sequence-parallel rank passes the
global positions of the tokens it holds (two zigzag chunks), not 0..T-1. Positions travel as
`PositionRuns` (host integers, fixed once per batch layout): the tables are built from them on the
compute device, and attention reads its causal structure from them, never from the device.

    inv_freq, scale = rope_frequencies(head_dim, theta, scaling)      # [d/2], float
    cos, sin = rope_cos_sin(positions, head_dim, theta, scaling)      # [T, d] each, fp32
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tsp_trainer.config.model import FP32_EXACT_POSITIONS, ModelConfig, RopeScaling
from tsp_trainer.model.documents import Documents, rope_positions


@dataclass(frozen=True)
class PositionRuns:
    """Global positions of the tokens in hand as runs of consecutive positions, in token order:
    ((first position, length), ...); e.g. rank p's two zigzag chunks. Host integers, fixed once per
    batch layout, so attention never reads positions back from the device (a host sync per call)."""

    runs: tuple[tuple[int, int], ...]
    # Document starts of the full rows these tokens come from (document masking), or None: every
    # token sees its whole causal prefix (model/documents.py).
    documents: Documents | None = None

    @classmethod
    def contiguous(cls, length: int, first: int = 0) -> "PositionRuns":
        return cls(((first, length),))

    def with_documents(self, documents: Documents | None) -> "PositionRuns":
        return PositionRuns(self.runs, documents)

    @classmethod
    def of(cls, positions: torch.Tensor) -> "PositionRuns":
        """Runs of a positions tensor [T] (reads it: one host sync if it lives on a GPU)."""
        runs: list[list[int]] = []
        for p in positions.tolist():
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
    passes the positions of its own slice (e.g. two zigzag chunks). With document masking
    `documents` holds the rows' document starts; with reset_positions the tables are per row,
    cos, sin [B, T, head_dim], at positions restarted per document. `attention_kernel`: the run's
    attention kernel (train.attention_kernel's choice), `attention_gqa` its GQA path
    (train.attention_gqa's), for every attention call of the pass."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    runs: tuple[tuple[int, int, int], ...] = ()     # (start, stop, first position) per run
    documents: Documents | None = None
    attention_kernel: str = "fa2"
    attention_gqa: str = "native"

    @classmethod
    def build(cls, positions: "PositionRuns | torch.Tensor", head_dim: int, theta: float,
              scaling: RopeScaling | None = None, device=None, attention_kernel: str = "fa2",
              attention_gqa: str = "native") -> "Rotary":
        """From runs (no host sync: the tables are built on `device`) or a positions tensor."""
        if isinstance(positions, torch.Tensor):
            runs = PositionRuns.of(positions)
            tensor = positions if device is None else positions.to(device)
        else:
            runs, tensor = positions, positions.tensor(device)
        docs = runs.documents
        reset = docs is not None and docs.reset_positions
        check_fp32_positions(_largest_position(runs, docs) if reset else
                             max((first + n - 1 for first, n in runs.runs), default=0))
        if reset:
            tensor = rope_positions(runs.runs, docs, device=tensor.device)          # [B, T]
        cos, sin = rope_cos_sin(tensor, head_dim, theta, scaling)
        return cls(tensor, cos, sin, runs.query_runs(), docs, attention_kernel, attention_gqa)

    @classmethod
    def for_model(cls, positions: "PositionRuns | torch.Tensor", cfg: ModelConfig, device=None,
                  attention_kernel: str = "fa2", attention_gqa: str = "native") -> "Rotary":
        return cls.build(positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, device, attention_kernel,
                         attention_gqa)


def check_fp32_positions(largest: int) -> None:
    """Refuse positions that fp32 angles cannot represent exactly (FP32_EXACT_POSITIONS; one host
    comparison)."""
    if largest >= FP32_EXACT_POSITIONS:
        raise ValueError(f"RoPE position {largest} is not exact in fp32 (the angles' dtype, as in "
                         "transformers): positions must be < 2^24 = 16,777,216, so data.seq_len "
                         "<= 16777216 (or documents that short with data.reset_positions=true)")


def _largest_position(runs: PositionRuns, docs: Documents) -> int:
    """The largest position restarted per document among the tokens in hand (from the plan
    attention reuses: a segment's last query sits at k_stop - 1, its document starts at k_start)."""
    return max((s.k_stop - 1 - s.k_start for row in docs.plan(runs.query_runs()) for s in row.segments),
               default=0)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, scaling: RopeScaling | None = None,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [T, head_dim] for integer positions [T] (global token positions), or
    [B, T, head_dim] for per-row positions [B, T], scaled by the RoPE type's attention factor
    (yarn; 1 otherwise) as transformers does."""
    inv_freq, attention_scaling = rope_frequencies(head_dim, theta, scaling, device=positions.device)
    freqs = positions.to(torch.float32)[..., None] * inv_freq              # [(B,) T, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)                                # [T, d]
    cos, sin = emb.cos(), emb.sin()
    if attention_scaling != 1.0:
        cos, sin = cos * attention_scaling, sin * attention_scaling
    return cos.to(dtype), sin.to(dtype)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None,
                     device=None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2] fp32, attention scaling of cos/sin)."""
    if scaling is None:
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
        return 1.0 / (theta ** exponents), 1.0
    return _SCALINGS[scaling.rope_type](head_dim, theta, scaling, device)


def _base_inv_freq(head_dim: int, theta: float, device) -> torch.Tensor:
    # transformers builds the scaled types from an int64 arange cast to fp32 (same values); made on
    # the compute device (a host arange copied there would be a blocking copy per forward)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).to(torch.float32)
    return 1.0 / (theta ** (exponents / head_dim))


def _linear(head_dim: int, theta: float, s: RopeScaling, device) -> tuple[torch.Tensor, float]:
    """Position interpolation (Chen et al. 2023): every frequency divided by `factor`."""
    inv_freq = _base_inv_freq(head_dim, theta, device)
    inv_freq /= s.factor
    return inv_freq, 1.0


def _llama3(head_dim: int, theta: float, s: RopeScaling, device) -> tuple[torch.Tensor, float]:
    """Llama 3.1: wavelengths longer than original / low_freq_factor are divided by `factor`,
    shorter than original / high_freq_factor kept, a smooth blend in between."""
    inv_freq = _base_inv_freq(head_dim, theta, device)
    old_context = s.original_max_position_embeddings
    low_freq_wavelen = old_context / s.low_freq_factor
    high_freq_wavelen = old_context / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


def _yarn(head_dim: int, theta: float, s: RopeScaling, device) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023, arXiv 2309.00071): NTK-by-parts interpolation between the original
    frequencies (fast dimensions, > beta_fast rotations over the original context) and the
    interpolated ones (slow dimensions, < beta_slow rotations), plus an attention factor on cos/sin."""
    factor, orig = s.factor, s.original_max_position_embeddings
    attention_factor = s.attention_factor
    if attention_factor is None:
        if s.mscale and s.mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, s.mscale) / _yarn_mscale(factor, s.mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = s.beta_fast or 32, s.beta_slow or 1
    truncate = True if s.truncate is None else s.truncate

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001                                       # transformers: avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32, device=device) - low)
                       / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, device=device).to(torch.float32) / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, attention_factor


def _yarn_mscale(scale: float, mscale: float = 1) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


_SCALINGS = {"linear": _linear, "llama3": _llama3, "yarn": _yarn}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, heads, d]; cos/sin: [T, d] or per row [B, T, d] (fp32 tables, applied in x's
    dtype as HF does)."""
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    return x * cos + _rotate_half(x) * sin


def apply_rope_backward(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The gradient of apply_rope with respect to x, for a backward written by hand (TSP's
    attention): rotate_half is a signed permutation R, so d/dx (x cos + R(x) sin) applied to dy is
    dy cos + R^T(dy sin), with R^T(z) = [z2, -z1] = -R(z). dy: [B, T, heads, d]."""
    cos, sin = cos.unsqueeze(-2).to(dy.dtype), sin.unsqueeze(-2).to(dy.dtype)
    z1, z2 = (dy * sin).chunk(2, dim=-1)
    return dy * cos + torch.cat((z2, -z1), dim=-1)
