"""FLOPs per token of one training step: the model FLOPs MFU is quoted in and the hardware FLOPs a
scheme really executes, recomputation included."""

from __future__ import annotations

from tsp_trainer.config import ModelConfig
from tsp_trainer.observability.flops import (attention_flops_per_token, block_matmul_params,
                                             flops_per_token)
from tsp_trainer.plan.layout import Layout


def hardware_flops_per_token(cfg: ModelConfig, layout: Layout, seq_len: int) -> dict[str, float]:
    """Model FLOPs (observability/flops.py: causal attention halved, backward = 2 x forward) and the
    FLOPs the code really executes, + what its backward recomputes. TSP with full recompute saves
    only X_p: its attention backward re-runs the q/k/v projections and the attention forward
    (not W_o: dW_o and dA need only A and dy) and its MLP backward the gate and up projections (not
    W_down); with tsp_recompute=selective the attention part is kept, only gate/up are re-run;
    with tsp_recompute=none gate/up are kept too and backward re-runs no forward GEMM. SP-style
    context attention recomputes the attention core; activation checkpointing replays each block
    once more (every matmul)."""
    model = flops_per_token(cfg, seq_len)
    block_fwd = 2 * block_matmul_params(cfg) + attention_flops_per_token(cfg, seq_len)
    core_fwd = attention_flops_per_token(cfg, seq_len)
    _, s_p, _ = layout.axes
    extra = 0.0
    if layout.scheme == "tsp":
        L, h = cfg.num_layers, cfg.hidden_size
        qkv_proj = 2 * L * h * (cfg.num_heads * cfg.head_dim + 2 * cfg.kv_hidden_size)
        gate_up = 2 * L * 2 * h * cfg.intermediate_size
        extra += ((0 if layout.keeps_mlp else gate_up)
                  + (0 if layout.keeps_attention else qkv_proj + core_fwd))
    elif s_p > 1:
        extra += core_fwd
    if layout.activation_checkpointing:
        extra += block_fwd
    return {"model": model, "hardware": model + extra}


__all__ = ["hardware_flops_per_token"]
