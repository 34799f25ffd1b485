"""Per-rank model state in bytes: parameters, gradients (with the fp32 accumulation buffer the
trainer configures) and AdamW's optimizer state, split over T by the sharding plan and over DP by
ZeRO."""

from __future__ import annotations

import math

from tsp_trainer.config import ModelConfig
from tsp_trainer.plan.layout import Layout
from tsp_trainer.plan.precision import BF16, Precision


def param_count(cfg: ModelConfig, layout: Layout) -> int:
    """Parameters held by one rank: the matrices and the q/k/v, gate/up biases split over T (heads,
    intermediate block, vocab rows), norms and the o_proj / down_proj biases replicated
    (parallel/apply.py TSP_PLAN, baselines/apply.py: the same plan)."""
    t, _, _ = layout.axes
    h, L = cfg.hidden_size, cfg.num_layers
    split = (L * (cfg.attn_sharded_params + cfg.mlp_sharded_params)
             + cfg.vocab_size * h * (1 if cfg.tie_embeddings else 2))
    return split // t + (2 * L + 1) * h + L * cfg.replicated_biases


def state_bytes(cfg: ModelConfig, layout: Layout, prec: Precision = BF16) -> dict[str, int]:
    """Per-rank parameter, gradient and optimizer bytes. ZeRO shards over DP (the ranks holding the
    same shard): stage 1 the fp32 master + moments, stage 2 also the gradients."""
    n = param_count(cfg, layout)
    dp = layout.dp
    opt = n * prec.optimizer
    if layout.zero_stage >= 1:
        opt = math.ceil(opt / dp)
    return {"params": n * prec.weight, "grads": grad_bytes(n, layout.zero_stage, dp, prec),
            "optimizer": opt, "param_count": n}


def grad_bytes(n: int, zero_stage: int, dp: int, prec: Precision = BF16) -> int:
    """Gradient memory per rank for n parameters: stage 0 the gradients in the weights' dtype (bf16
    with stage 0 accumulates in bf16: modelled, but refused by the trainer); stage 1 the gradients
    plus the full fp32 accumulation buffer (BF16_Optimizer); stage 2 the fp32 partition (the bf16
    gradients are freed bucket by bucket as they are reduced)."""
    if zero_stage == 0:
        return n * prec.grad
    if zero_stage == 1:
        return n * (prec.grad + prec.grad_accum)
    return math.ceil(n * (prec.grad_accum or prec.grad) / dp)


__all__ = ["grad_bytes", "param_count", "state_bytes"]
