"""Model shape: a frozen dataclass and the named sizes (tiny, 125m, 1b, 7b, 7b_ffn4x)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    """Llama-style dense decoder shape. Field names follow Hugging Face's LlamaConfig where one exists."""

    vocab_size: int = 1024
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 128
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                    "intermediate_size", "max_seq_len"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"model.{key}={value!r} must be a positive integer")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"model.hidden_size={self.hidden_size} must be divisible by "
                             f"model.num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model.num_kv_heads={self.num_kv_heads} must divide "
                             f"model.num_heads={self.num_heads} (GQA groups)")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError(f"head_dim={self.hidden_size // self.num_heads} (model.hidden_size / "
                             "model.num_heads) must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_hidden_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def num_params(self, *, include_embeddings: bool = True) -> int:
        """Closed-form parameter count (tests compare it with the built module)."""
        h, kv, inter = self.hidden_size, self.kv_hidden_size, self.intermediate_size
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * inter + 2 * h   # attn + gated MLP + 2 norms
        total = self.num_layers * per_layer + h                        # + final norm
        if include_embeddings:
            total += self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return total


# Named sizes. 7b is Llama-2-7B's shape (SwiGLU intermediate 11008, ~6.74B parameters);
# 7b_ffn4x is the paper's literal "FFN x4" gated MLP (intermediate 16384, ~8.9B parameters),
# see TSP_PAPER.md section 7.1 for the ambiguity.
MODEL_SIZES: dict[str, ModelConfig] = {
    "tiny": ModelConfig(vocab_size=1024, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                        intermediate_size=128, max_seq_len=1024),
    "125m": ModelConfig(vocab_size=32000, hidden_size=768, num_layers=12, num_heads=12,
                        num_kv_heads=12, intermediate_size=2048, max_seq_len=8192),
    "1b": ModelConfig(vocab_size=32000, hidden_size=2048, num_layers=16, num_heads=16,
                      num_kv_heads=16, intermediate_size=5632, max_seq_len=8192),
    "7b": ModelConfig(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32,
                      num_kv_heads=32, intermediate_size=11008, max_seq_len=131072,
                      rope_theta=500000.0),
    "7b_ffn4x": ModelConfig(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32,
                            num_kv_heads=32, intermediate_size=16384, max_seq_len=131072,
                            rope_theta=500000.0),
}


def model_config(size: str, **overrides) -> ModelConfig:
    """Return the named size, optionally with fields overridden."""
    if size not in MODEL_SIZES:
        raise ValueError(f"model.size={size!r} is not a known size; use one of {sorted(MODEL_SIZES)}")
    return MODEL_SIZES[size].replace(**overrides)
