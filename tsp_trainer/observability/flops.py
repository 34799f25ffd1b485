"""FLOPs per token of a Llama-style dense decoder: the one count of model FLOPs (the MFU
numerator) and, given the recompute a layout runs, of hardware FLOPs (the HFU numerator). Pure
arithmetic on a ModelConfig: imports nothing but config. The planner (plan/flops.py) decides the
recompute of a layout and calls this; tools/flop_count.py counts the FLOPs the real code executes,
the independent check of this formula (tests/unit/test_plan_flops.py).

A step is made of forward pieces, each with forward FLOPs per token f (all layers; L layers,
hidden size h, I intermediate, V vocabulary, H query heads of head_dim d, kv = K/V channels, S the
full, unsharded sequence: under TSP or context parallelism every query still sees its prefix):

    qkv      2 L h (H d + 2 kv)      core  2 L S H d (Q K^T and P V over the causal half)
    o        2 L H d h               gate_up 4 L h I      down 2 L I h      head 2 V h

Model FLOPs = 3 f per piece (backward = 2 x forward); the LM head counts even when tied. Hardware
FLOPs = f x (1 + recompute[piece] + BACKWARD_COST[piece]): the forward re-runs the layout adds, and
the flash backward's rebuilt scores (2.5 x the core's forward). `causal_half=False` counts the full
S x S square (Megatron's older 72 B s L h^2 (1 + s/6h + V/12Lh)). Document masking does less work;
like everyone else we count the full causal window.
"""

from __future__ import annotations

from collections.abc import Mapping

from tsp_trainer.config import ModelConfig

BLOCK_PIECES = ("qkv", "core", "o", "gate_up", "down")
PIECES = BLOCK_PIECES + ("head",)

# backward FLOPs of a piece in units of its forward: GEMMs dX + dW; flash attention's backward
# recomputes Q K^T, then dP = dO V^T, dV, dQ, dK (5 score-sized matmuls against the forward's 2)
BACKWARD_COST = {"qkv": 2.0, "core": 2.5, "o": 2.0, "gate_up": 2.0, "down": 2.0, "head": 2.0}


def forward_pieces(cfg: ModelConfig, seq_len: int, *, causal_half: bool = True) -> dict[str, float]:
    """Forward FLOPs per token of each piece, all layers (module docstring)."""
    if seq_len <= 0:
        raise ValueError(f"seq_len={seq_len} must be a positive number of tokens")
    L, h, inter = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    q_channels = cfg.num_heads * cfg.head_dim
    core = 2 * L * seq_len * q_channels
    return {"qkv": 2 * L * h * (q_channels + 2 * cfg.kv_hidden_size),
            "core": core if causal_half else 2 * core,
            "o": 2 * L * q_channels * h,
            "gate_up": 4 * L * h * inter,
            "down": 2 * L * inter * h,
            "head": 2 * cfg.vocab_size * h}


def flops_per_token(cfg: ModelConfig, seq_len: int, *, training: bool = True, causal_half: bool = True,
                    causal_full: bool = False, recompute: Mapping[str, int] | None = None) -> float:
    """FLOPs per token of one forward (training=False) or one training step.

    Args:
        seq_len: the full sequence length S the attention term is computed for.
        causal_half: count causal attention as half the S x S square (default).
        causal_full: alias for causal_half=False.
        recompute: None for model FLOPs; for hardware FLOPs, the forward re-runs of each piece the
            layout adds (plan/flops.py `recompute_runs`; a piece left out runs once).
    """
    half = causal_half and not causal_full
    if not training:
        return float(sum(forward_pieces(cfg, seq_len, causal_half=half).values()))
    return float(sum(piece_flops(cfg, seq_len, causal_half=half, recompute=recompute).values()))


def piece_flops(cfg: ModelConfig, seq_len: int, *, causal_half: bool = True,
                recompute: Mapping[str, int] | None = None) -> dict[str, float]:
    """Training FLOPs per token of each piece: 3 f (model FLOPs) when `recompute` is None, else
    f x (1 + recompute[piece] + BACKWARD_COST[piece]) (hardware FLOPs)."""
    f = forward_pieces(cfg, seq_len, causal_half=causal_half)
    if recompute is None:
        return {p: 3.0 * f[p] for p in PIECES}
    return {p: f[p] * (1 + recompute.get(p, 0) + BACKWARD_COST[p]) for p in PIECES}


def block_matmul_params(cfg: ModelConfig) -> int:
    """Weights that enter a matmul in the L decoder blocks (no norms, no embedding, no head)."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_hidden_size, cfg.kv_hidden_size, cfg.intermediate_size
    return cfg.num_layers * (2 * h * q + 2 * h * kv + 3 * h * inter)


def matmul_params(cfg: ModelConfig) -> int:
    """Matmul parameters of the blocks plus the LM head."""
    return block_matmul_params(cfg) + cfg.vocab_size * cfg.hidden_size


def attention_flops_per_token(cfg: ModelConfig, seq_len: int, *, causal_half: bool = True) -> float:
    """Forward FLOPs per token of Q K^T and A V over all layers (the `core` piece)."""
    return float(forward_pieces(cfg, seq_len, causal_half=causal_half)["core"])
