"""Per-rank model state in bytes: parameters, gradients (with the fp32 accumulation buffer the
trainer configures) and AdamW's optimizer state, split over T by the sharding plan and over DP by
ZeRO 1-2, or over every rank by ZeRO-3 (sp, ulysses: `zero3_state_bytes`, the peers' model too);
with optimizer offload (DeepSpeed's ZeRO-Offload), what the optimizer holds in host memory
instead."""

from __future__ import annotations

import math

from tsp_trainer.config import ModelConfig
from tsp_trainer.config.model import padded_vocab_size
from tsp_trainer.plan.layout import Layout
from tsp_trainer.plan.precision import BF16, Precision


def param_count(cfg: ModelConfig, layout: Layout) -> int:
    """Parameters held by one rank: the matrices and the q/k/v, gate/up biases split over T (heads,
    intermediate block, vocab rows), norms and the o_proj / down_proj biases replicated
    (parallel/apply.py TSP_PLAN, baselines/apply.py: the same plan). K/V heads fewer than T: each
    rank holds a copy of one (ModelConfig.attn_shard_params), with its gradient and optimizer state."""
    t, _, _ = layout.axes
    h, L = cfg.hidden_size, cfg.num_layers
    split = (L * cfg.mlp_sharded_params
             + padded_vocab_size(cfg.vocab_size, t) * h * (1 if cfg.tie_embeddings else 2))
    return (L * cfg.attn_shard_params(t) + split // t + (2 * L + 1) * h
            + L * (cfg.replicated_biases + cfg.head_norm_params))


# DeepSpeed's ZeRO optimizer keeps its master partition and the gradient its step reads in fp32
FP32_BYTES = 4


def state_bytes(cfg: ModelConfig, layout: Layout, prec: Precision = BF16) -> dict[str, int]:
    """Per-rank parameter, gradient and optimizer bytes on the GPU, and `host_optimizer`: the
    optimizer's bytes in host memory (0 unless layout.offload_optimizer). ZeRO shards over DP (the
    ranks holding the same shard): stage 1 the fp32 master + moments, stage 2 also the gradients.
    Optimizer offload moves the master and moments to the host; the gradients stay where ZeRO
    accumulates them (grad_bytes)."""
    n = param_count(cfg, layout)
    if layout.zero_stage == 3:
        return {**zero3_state_bytes(n, layout.world, prec, offload_optimizer=layout.offload_optimizer),
                "zero3_gathered": zero3_gathered_bytes(cfg, prec)[1], "param_count": n}
    dp = layout.dp
    opt = n * prec.optimizer
    if layout.zero_stage >= 1:
        opt = math.ceil(opt / dp)
    host = 0
    if layout.offload_optimizer:
        opt, host = 0, offloaded_optimizer_bytes(n, dp, prec)
    return {"params": n * prec.weight, "grads": grad_bytes(n, layout.zero_stage, dp, prec),
            "optimizer": opt, "host_optimizer": host, "param_count": n}


def zero3_state_bytes(n: int, world: int, prec: Precision = BF16, *, offload_optimizer: bool = False) -> dict[str, int]:
    """Per-rank state of n parameters under ZeRO-3 over `world` ranks (the trainer's sp and ulysses,
    the peers of plan/peers.py): the weight partition, the fp32 gradient partition and AdamW's
    master and moments, each n / world; with CPU Adam the gradient partition, master and moments
    live in pinned host memory (`host_optimizer`)."""
    return {"params": -(-n * prec.weight // world),
            "grads": 0 if offload_optimizer else -(-n * FP32_BYTES // world),
            "optimizer": 0 if offload_optimizer else -(-n * prec.optimizer // world),
            "host_optimizer": offloaded_optimizer_bytes(n, world, prec) if offload_optimizer else 0}


def zero3_layer_params(cfg: ModelConfig) -> int:
    """Parameters of one decoder layer, the unit ZeRO-3 gathers whole for its use."""
    return cfg.attn_sharded_params + cfg.mlp_sharded_params + cfg.replicated_biases + 2 * cfg.hidden_size


def zero3_gathered_bytes(cfg: ModelConfig, prec: Precision = BF16) -> tuple[int, int]:
    """(forward, backward) bytes of weights ZeRO-3 holds gathered on a rank: the layer in use and
    the one prefetched; in backward also the layer's gradients before their reduce-scatter."""
    layer = zero3_layer_params(cfg) * prec.weight
    return 2 * layer, 3 * layer


def offloaded_optimizer_bytes(n: int, dp: int, prec: Precision = BF16) -> int:
    """Pinned host bytes of one rank's ZeRO-Offload partition of n / dp parameters (DeepSpeed
    0.19.8 stage_1_and_2.py): the fp32 master (fp32 runs too: ZeRO clones the partition), the two
    AdamW moments, the partition's fp32 gradient the CPU step reads, and the updated partition in
    the weights' dtype that is copied back to the GPU."""
    return math.ceil(n * (FP32_BYTES + prec.moments + FP32_BYTES + prec.weight) / dp)


def grad_bytes(n: int, zero_stage: int, dp: int, prec: Precision = BF16) -> int:
    """Gradient memory per rank for n parameters: stage 0 the gradients in the weights' dtype (bf16
    with stage 0 accumulates in bf16: modelled, but refused by the trainer); stage 1 the gradients
    plus the full fp32 accumulation buffer (BF16_Optimizer; with optimizer offload the ZeRO
    optimizer's per-parameter fp32 `grad_accum`, the same bytes); stage 2 the fp32 partition (the
    bf16 gradients are freed bucket by bucket as they are reduced). Optimizer offload leaves these
    on the GPU: DeepSpeed accumulates and reduces there and copies the reduced fp32 partition to
    the host once per step."""
    if zero_stage == 0:
        return n * prec.grad
    if zero_stage == 1:
        return n * (prec.grad + prec.grad_accum)
    return math.ceil(n * (prec.grad_accum or prec.grad) / dp)


__all__ = ["FP32_BYTES", "grad_bytes", "offloaded_optimizer_bytes", "param_count", "state_bytes",
           "zero3_gathered_bytes", "zero3_layer_params", "zero3_state_bytes"]
