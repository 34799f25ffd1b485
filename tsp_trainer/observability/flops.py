"""FLOP count of a Llama-style dense decoder (the numerator of MFU). Pure arithmetic on a
ModelConfig: imports nothing but config.

The formula, per token, for a sequence of S tokens, L layers, hidden size h, vocabulary V:

    N_matmul = L * (2*h*q + 2*h*kv + 3*h*I) + V*h
               (Wq, Wo: h x q with q = num_heads * head_dim, = h unless head_dim is explicit;
               Wk, Wv: h x kv with kv = num_kv_heads * head_dim; gate/up/down:
               h x I; the LM head: V x h, counted even when tied to the embedding, because the
               head is a matmul and the embedding lookup is not. Norms, biases and RoPE are ignored.)

    forward  = 2 * N_matmul                              (one multiply-add = 2 FLOPs)
             + L * 2 * 2 * S * q * c                     (attention scores Q K^T and A V)
    training = 3 * forward                               (backward = 2x forward)

where c = 1/2 for causal attention counted as HALF of the full S x S score and value matmuls
(each query sees on average S/2 keys; the exact mean is (S+1)/2, a negligible difference), and c = 1
when `causal_half=False` (alias `causal_full=True`): the full square, as in Megatron-LM's older formula
72*B*s*L*h^2 * (1 + s/(6h) + V/(12*L*h)) (Narayanan et al., 2021), whose attention term per token is
12*L*s*h. GQA does not change the attention term: all num_heads * head_dim = q query channels score
against S keys.

S is the full (unsharded) sequence length: under TSP or context parallelism each rank holds S/D
tokens but every query still attends over the whole causal prefix. Document masking in packed
sequences does less work than this; like everyone else we count the full causal window.

Model FLOPs (MFU) count the math the model needs. Hardware FLOPs (HFU), what a layout really
executes with its recomputation (activation checkpointing's replay, TSP's own recompute, the flash
backward's rebuilt scores), are the planner's `plan/flops.py::hardware_flops_per_token`, proven equal
to torch's FLOP counter on the real code; the trainer logs both from there.
"""

from __future__ import annotations

from tsp_trainer.config import ModelConfig


def block_matmul_params(cfg: ModelConfig) -> int:
    """Weights that enter a matmul in the L decoder blocks (no norms, no embedding, no head)."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_hidden_size, cfg.kv_hidden_size, cfg.intermediate_size
    return cfg.num_layers * (2 * h * q + 2 * h * kv + 3 * h * inter)


def matmul_params(cfg: ModelConfig) -> int:
    """Non-embedding matmul parameters plus the LM head (N_matmul in the module docstring)."""
    return block_matmul_params(cfg) + cfg.vocab_size * cfg.hidden_size


def attention_flops_per_token(cfg: ModelConfig, seq_len: int, *, causal_half: bool = True) -> float:
    """Forward FLOPs per token of Q K^T and A V over all layers: L * 2 * 2 * S * q, halved if causal."""
    if seq_len <= 0:
        raise ValueError(f"seq_len={seq_len} must be a positive number of tokens")
    full = cfg.num_layers * 2 * 2 * seq_len * cfg.q_hidden_size
    return full / 2 if causal_half else float(full)


def flops_per_token(cfg: ModelConfig, seq_len: int, *, training: bool = True, causal_half: bool = True,
                    causal_full: bool = False) -> float:
    """FLOPs per token of one forward (training=False) or forward + backward (training=True).

    Args:
        seq_len: the full sequence length S the attention term is computed for.
        causal_half: count causal attention as half the S x S square (default; see module docstring).
        causal_full: alias for causal_half=False, the full square (Megatron's older formula).
    """
    half = causal_half and not causal_full
    block_fwd = 2 * block_matmul_params(cfg) + attention_flops_per_token(cfg, seq_len, causal_half=half)
    head_fwd = 2 * cfg.vocab_size * cfg.hidden_size
    if not training:
        return float(block_fwd + head_fwd)
    return float(3 * (block_fwd + head_fwd))
