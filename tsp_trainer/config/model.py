"""Model shape: a frozen dataclass, RoPE scaling as data, and the named sizes.

Families (Llama 2 / 3.x, Mistral, Qwen2 / 2.5, Qwen3) are data, not subclasses: `family` names the
Hugging Face model_type export writes back, and the fields `qkv_bias`, `o_bias`, `mlp_bias`,
`qk_norm`, `head_dim`, `rope_scaling` and `sliding_window` say what differs. The rules each family imposes on them are checked here, so a
ModelConfig always describes a model transformers' class of that family computes identically.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# RoPE angles are position x inv_freq in fp32 (model/rope.py, as transformers computes them): an
# integer position is exact in fp32 up to 2^24, so sequences (with data.reset_positions,
# documents) of up to 2^24 = 16,777,216 tokens get their exact positions.
FP32_EXACT_POSITIONS = 1 << 24

# rope_type -> (required keys, optional keys), as transformers' RotaryEmbeddingConfigMixin
# validates them (modeling_rope_utils.py, transformers 5.24). "default" is RoPE without scaling
# (ModelConfig.rope_scaling = None).
ROPE_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "linear": (("factor",), ()),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")),
}


@dataclass(frozen=True)
class RopeScaling:
    """A scaled RoPE, with transformers' key names (`rope_parameters` / legacy `rope_scaling`).
    None for an optional key means transformers' default (yarn: beta_fast 32, beta_slow 1,
    truncate true, attention_factor from factor / mscale / mscale_all_dim)."""

    rope_type: str                                 # linear | llama3 | yarn
    factor: float | None = None                    # context extension ratio
    original_max_position_embeddings: int | None = None   # llama3, yarn: pretraining context
    low_freq_factor: float | None = None           # llama3
    high_freq_factor: float | None = None          # llama3
    attention_factor: float | None = None          # yarn: cos/sin scale
    beta_fast: float | None = None                 # yarn: extrapolation boundary (rotations)
    beta_slow: float | None = None                 # yarn: interpolation boundary (rotations)
    mscale: float | None = None                    # yarn (DeepSeek style attention_factor)
    mscale_all_dim: float | None = None            # yarn
    truncate: bool | None = None                   # yarn: round the correction range to integers

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_KEYS:
            raise ValueError(f"model.rope_scaling.rope_type={self.rope_type!r} is not supported; use "
                             f"one of {', '.join(ROPE_KEYS)} (or 'default' for no scaling)")
        required, optional = ROPE_KEYS[self.rope_type]
        given = {k for k, v in self.to_dict().items() if k != "rope_type"}
        missing = [k for k in required if k not in given]
        if missing:
            raise ValueError(f"model.rope_scaling.rope_type={self.rope_type!r} needs "
                             + ", ".join(f"model.rope_scaling.{k}" for k in missing))
        extra = sorted(given - set(required) - set(optional))
        if extra:
            raise ValueError(f"model.rope_scaling.{extra[0]}={getattr(self, extra[0])!r} is not a "
                             f"parameter of rope_type {self.rope_type!r} (it takes "
                             f"{', '.join(required + optional)})")
        for key in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"):
            value = getattr(self, key)
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"model.rope_scaling.{key}={value!r} must be a number > 0")
        orig = self.original_max_position_embeddings
        if orig is not None and (not isinstance(orig, int) or isinstance(orig, bool) or orig <= 0):
            raise ValueError(f"model.rope_scaling.original_max_position_embeddings={orig!r} must be a "
                             "positive integer (the pretraining context length)")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"model.rope_scaling.high_freq_factor={self.high_freq_factor} must be above "
                             f"model.rope_scaling.low_freq_factor={self.low_freq_factor} (llama3 scaling "
                             "interpolates between the two wavelength bounds)")

    def to_dict(self) -> dict[str, Any]:
        """transformers' rope_parameters keys (rope_theta aside), unset keys left out."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


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
    family: str = "llama"                      # HF model_type: llama | mistral | qwen2 | qwen3
    qkv_bias: bool = False                     # biases of q_proj, k_proj, v_proj (Qwen2; Llama attention_bias)
    o_bias: bool = False                       # bias of o_proj (Llama attention_bias)
    mlp_bias: bool = False                     # biases of gate/up/down_proj (Llama mlp_bias)
    rope_scaling: RopeScaling | None = None    # None = plain RoPE with rope_theta
    # The source model's attention window (Mistral). The model computes full causal attention, which
    # is the same while data.seq_len <= sliding_window; kept so export writes it back.
    sliding_window: int | None = None
    bos_token_id: int | None = None            # from an imported config.json; written back on export
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # Channels per attention head. None (or hidden_size / num_heads) = hidden_size / num_heads; any
    # other value makes the q/o projections [num_heads * head_dim, h] / [h, num_heads * head_dim]
    # (Mistral-Nemo, Qwen3). Read back resolved: cfg.head_dim is always an int.
    head_dim: int | None = None
    qk_norm: bool = False                      # RMSNorm over each q and k head before RoPE (Qwen3)

    def __post_init__(self) -> None:
        for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                    "intermediate_size", "max_seq_len"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"model.{key}={value!r} must be a positive integer")
        given = self.head_dim
        if given is not None and (not isinstance(given, int) or isinstance(given, bool) or given <= 0):
            raise ValueError(f"model.head_dim={given!r} must be a positive integer or null "
                             "(null: model.hidden_size / model.num_heads)")
        natural = self.hidden_size // self.num_heads
        if given is None and self.hidden_size % self.num_heads:
            raise ValueError(f"model.hidden_size={self.hidden_size} must be divisible by "
                             f"model.num_heads={self.num_heads} (or set model.head_dim)")
        # stored resolved: a head_dim equal to hidden_size / num_heads counts as derived (replace()
        # derives it again from a new shape, to_dict() writes null)
        object.__setattr__(self, "head_dim", natural if given is None else given)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model.num_kv_heads={self.num_kv_heads} must divide "
                             f"model.num_heads={self.num_heads} (GQA groups)")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} (model.head_dim, or model.hidden_size / "
                             "model.num_heads) must be even for RoPE")
        if not (isinstance(self.rope_theta, (int, float)) and math.isfinite(self.rope_theta)
                and self.rope_theta > 1):
            raise ValueError(f"model.rope_theta={self.rope_theta!r} must be a number > 1 (the RoPE base)")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"model.rope_scaling={self.rope_scaling!r} must be a RopeScaling or None")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int)
                                                or self.sliding_window <= 0):
            raise ValueError(f"model.sliding_window={self.sliding_window!r} must be a positive integer or null")
        _check_family(self)

    @property
    def _derived_head_dim(self) -> bool:
        return self.head_dim * self.num_heads == self.hidden_size

    @property
    def q_hidden_size(self) -> int:
        """Query channels, num_heads * head_dim (= hidden_size unless head_dim is explicit)."""
        return self.num_heads * self.head_dim

    @property
    def kv_hidden_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    # Per-layer parameter counts, split the way every weight-sharding scheme splits them (the
    # planner, the communication models and the checkpoint layout use these).
    @property
    def attn_sharded_params(self) -> int:
        """W_q, W_k, W_v, W_o and the q/k/v biases: split by heads."""
        h, q, kv = self.hidden_size, self.q_hidden_size, self.kv_hidden_size
        return 2 * h * q + 2 * h * kv + ((q + 2 * kv) if self.qkv_bias else 0)

    def kv_repeat(self, degree: int) -> int:
        """How many ranks of a D-way weight split share one K/V head: 1 when D <= num_kv_heads (each
        rank holds n_kv / D of them), D / n_kv when fewer (each holds a copy of the one its query
        heads use, as Megatron and DeepSpeed replicate K/V heads)."""
        return max(1, degree // self.num_kv_heads)

    def kv_shard_hidden(self, degree: int) -> int:
        """K/V channels one rank of a D-way head split holds: n_kv / D heads, or one (a copy) when
        they are fewer than D."""
        return self.kv_hidden_size * self.kv_repeat(degree) // degree

    def attn_shard_params(self, degree: int) -> int:
        """W_q, W_k, W_v, W_o and the q/k/v biases one rank of a D-way head split holds: n_h / D
        query heads and max(n_kv / D, 1) K/V heads (a copy when they are fewer than D)."""
        h, q, kv = self.hidden_size, self.q_hidden_size // degree, self.kv_shard_hidden(degree)
        return 2 * h * q + 2 * h * kv + ((q + 2 * kv) if self.qkv_bias else 0)

    @property
    def mlp_sharded_params(self) -> int:
        """W_gate, W_up, W_down and the gate/up biases: split along the intermediate dim."""
        h, inter = self.hidden_size, self.intermediate_size
        return 3 * h * inter + (2 * inter if self.mlp_bias else 0)

    @property
    def replicated_biases(self) -> int:
        """Biases added once per token after a sum over shards (o_proj, down_proj): replicated."""
        return self.hidden_size * (int(self.o_bias) + int(self.mlp_bias))

    @property
    def head_norm_params(self) -> int:
        """q_norm and k_norm weights [head_dim] each (Qwen3): replicated, per layer."""
        return 2 * self.head_dim if self.qk_norm else 0

    def replace(self, **changes) -> "ModelConfig":
        """A copy with `changes`; a head_dim that was derived is derived again from the new shape."""
        if "head_dim" not in changes and self._derived_head_dim:
            changes["head_dim"] = None
        return dataclasses.replace(self, **changes)

    def num_params(self, *, include_embeddings: bool = True) -> int:
        """Closed-form parameter count (tests compare it with the built module)."""
        h = self.hidden_size
        per_layer = (self.attn_sharded_params + self.mlp_sharded_params + self.replicated_biases
                     + self.head_norm_params + 2 * h)
        total = self.num_layers * per_layer + h                        # + final norm
        if include_embeddings:
            total += self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return total

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly (checkpoint meta.json); `from_dict` reads it back to an equal config. A
        derived head_dim is written as null."""
        out = dataclasses.asdict(self)
        if self._derived_head_dim:
            out["head_dim"] = None
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        """Inverse of to_dict. Keys a checkpoint written before a field existed lacks take the
        field's default (which is what that checkpoint computed)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"model config has unknown keys {unknown} (written by a newer tsp_trainer?)")
        values = dict(data)
        if isinstance(values.get("rope_scaling"), dict):
            values["rope_scaling"] = RopeScaling(**values["rope_scaling"])
        if values.get("eos_token_id") is not None:
            values["eos_token_id"] = tuple(values["eos_token_id"])
        return cls(**values)


def _check_family(cfg: ModelConfig) -> None:
    """What transformers' class of each family can express (so export is exact)."""
    if cfg.family not in FAMILIES:
        raise ValueError(f"model.family={cfg.family!r} is not one of {', '.join(FAMILIES)}")
    biases = {"qkv_bias": cfg.qkv_bias, "o_bias": cfg.o_bias, "mlp_bias": cfg.mlp_bias}
    rules = {
        # LlamaConfig.attention_bias covers q, k, v and o together; mlp_bias gate, up and down.
        "llama": (cfg.qkv_bias == cfg.o_bias, "has one attention_bias for q, k, v and o: set "
                  "model.qkv_bias and model.o_bias alike"),
        "mistral": (not any(biases.values()), "has no biases: set model.qkv_bias, model.o_bias "
                    "and model.mlp_bias to false"),
        "qwen2": (cfg.qkv_bias and not cfg.o_bias and not cfg.mlp_bias, "hard-codes q/k/v biases "
                  "and no o_proj or MLP bias: set model.qkv_bias=true, model.o_bias=false, "
                  "model.mlp_bias=false"),
        # Qwen3Config.attention_bias covers q, k, v and o together; the MLP has no bias.
        "qwen3": (cfg.qkv_bias == cfg.o_bias and not cfg.mlp_bias, "has one attention_bias for q, "
                  "k, v and o and no MLP bias: set model.qkv_bias and model.o_bias alike, "
                  "model.mlp_bias=false"),
    }
    ok, rule = rules[cfg.family]
    if not ok:
        shown = ", ".join(f"model.{k}={str(v).lower()}" for k, v in biases.items())
        raise ValueError(f"model.family={cfg.family!r} with {shown}: transformers' {cfg.family} {rule}")
    if cfg.qk_norm != (cfg.family == "qwen3"):
        raise ValueError(f"model.family={cfg.family!r} with model.qk_norm={str(cfg.qk_norm).lower()}: "
                         "transformers' qwen3 always normalises q and k per head and the other "
                         "families never do: set model.qk_norm="
                         f"{str(cfg.family == 'qwen3').lower()}")
    if cfg.sliding_window is not None and cfg.family != "mistral":
        raise ValueError(f"model.sliding_window={cfg.sliding_window} is only represented for "
                         f"model.family='mistral' (got {cfg.family!r})")


# Named sizes. 7b is Llama-2-7B's shape (SwiGLU intermediate 11008, ~6.74B parameters);
# 7b_ffn4x is the TSP paper's "FFN x4" read literally as a gated MLP of width 4h (intermediate
# 16384, ~8.9B parameters). The paper's "7B" with "FFN x4" fits only one of them: 7b if "7B" is
# the count (11008 ~ 2/3 x 4h, the usual gated-MLP scaling), 7b_ffn4x if "x4" is the width.
# llama3_8b, qwen2_5_7b, qwen3_8b and mistral_7b are the shapes (no weights, no tokenizer ids) of
# the released models' config.json: Llama-3.1-8B, Qwen2.5-7B, Qwen3-8B and Mistral-7B-v0.3.
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
    # Llama-3.1-8B: GQA 32/8, vocab 128256, 128K positions from 8K by llama3 RoPE scaling x8.
    "llama3_8b": ModelConfig(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                             num_kv_heads=8, intermediate_size=14336, max_seq_len=131072,
                             rope_theta=500000.0, norm_eps=1e-5,
                             rope_scaling=RopeScaling("llama3", factor=8.0, low_freq_factor=1.0,
                                                      high_freq_factor=4.0,
                                                      original_max_position_embeddings=8192)),
    # Qwen2.5-7B: GQA 28/4 with q/k/v biases, vocab 152064, theta 1e6, 128K positions.
    "qwen2_5_7b": ModelConfig(vocab_size=152064, hidden_size=3584, num_layers=28, num_heads=28,
                              num_kv_heads=4, intermediate_size=18944, max_seq_len=131072,
                              rope_theta=1000000.0, norm_eps=1e-6, family="qwen2", qkv_bias=True),
    # Qwen3-8B: GQA 32/8, q/k RMSNorm per head, head_dim 128, vocab 151936, theta 1e6, 40K positions.
    "qwen3_8b": ModelConfig(vocab_size=151936, hidden_size=4096, num_layers=36, num_heads=32,
                            num_kv_heads=8, intermediate_size=12288, max_seq_len=40960,
                            rope_theta=1000000.0, norm_eps=1e-6, family="qwen3", head_dim=128,
                            qk_norm=True),
    # Mistral-7B-v0.3: GQA 32/8, vocab 32768, theta 1e6, no sliding window, 32K positions.
    "mistral_7b": ModelConfig(vocab_size=32768, hidden_size=4096, num_layers=32, num_heads=32,
                              num_kv_heads=8, intermediate_size=14336, max_seq_len=32768,
                              rope_theta=1000000.0, norm_eps=1e-5, family="mistral"),
}


def padded_vocab_size(vocab_size: int, degree: int) -> int:
    """The vocabulary rounded up to a multiple of the degree that splits it (Megatron's
    make-vocab-size-divisible-by): every rank holds the same number of rows, the last rows are
    padding that never receives probability (their logits are -inf in the loss)."""
    return -(-vocab_size // degree) * degree


def model_config(size: str, **overrides) -> ModelConfig:
    """Return the named size, optionally with fields overridden."""
    if size not in MODEL_SIZES:
        raise ValueError(f"model.size={size!r} is not a known size; use one of {sorted(MODEL_SIZES)}")
    return MODEL_SIZES[size].replace(**overrides)
