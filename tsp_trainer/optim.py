"""AdamW parameter groups and the warm-up + cosine learning-rate schedule (plain torch)."""

from __future__ import annotations

import math

import torch

from tsp_trainer.config import OptimSection


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices; never norms (1-D). Embedding and head matrices are decayed, as in Llama."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def adamw_hyperparameters(cfg: OptimSection) -> dict:
    """lr, betas and eps, as torch AdamW and DeepSpeedCPUAdam (engine/deepspeed.py) both take them;
    the weight decay is per param group (param_groups)."""
    return {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps}


def build_optimizer(model: torch.nn.Module, cfg: OptimSection) -> torch.optim.AdamW:
    # torch AdamW, not DeepSpeed's FusedAdam: no JIT build, same math under ZeRO 1/2.
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), **adamw_hyperparameters(cfg))


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warm-up from lr/warmup to lr over
    `warmup_steps`, then cosine decay to min_lr at `total_steps`."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimSection, total_steps: int):
    def factor(step: int) -> float:
        return lr_at(step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps,
                     total_steps=total_steps) / cfg.lr

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
