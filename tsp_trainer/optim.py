"""AdamW parameter groups and the warm-up + cosine learning-rate schedule (plain torch), and what a
resume does when the recipe's optimizer or schedule settings differ from the checkpoint's
(optim.on_resume_change, docs/checkpoints.md):

    changes = resume_changes(saved_config, cfg.to_dict())    # [(key, checkpoint value, recipe value)]
    line = resume_settings_applied(optimizer, scheduler, saved_config, cfg, policy="recipe")

unset: run/inputs.py refuses any change (exit 2, before start-up); `recipe`: the recipe's schedule
at the resumed step (its lr, min_lr, warm-up and total steps) and its betas and weight decay;
`checkpoint`: the saved schedule, betas and weight decay, whatever the recipe says (past the saved
train.steps the rate stays at the saved min_lr)."""

from __future__ import annotations

import math
from dataclasses import dataclass

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


# What the update and the rate of every step depend on, as (section, key) of the config.
RESUME_SETTINGS = (("optim", "lr"), ("optim", "min_lr"), ("optim", "warmup_steps"), ("train", "steps"),
                   ("optim", "beta1"), ("optim", "beta2"), ("optim", "weight_decay"))


@dataclass(frozen=True)
class Schedule:
    """Warm-up + cosine over total_steps: the schedule of one config."""

    lr: float
    min_lr: float
    warmup_steps: int
    total_steps: int

    @classmethod
    def of(cls, config: dict) -> Schedule:
        """The schedule of a config as a nested dict (TrainConfig.to_dict(), a checkpoint's YAML)."""
        optim = config["optim"]
        return cls(optim["lr"], optim["min_lr"], optim["warmup_steps"], config["train"]["steps"])

    def lr_at(self, step: int) -> float:
        return lr_at(step, lr=self.lr, min_lr=self.min_lr, warmup_steps=self.warmup_steps,
                     total_steps=self.total_steps)


def resume_changes(saved: dict, recipe: dict) -> list[tuple[str, object, object]]:
    """(key, checkpoint value, recipe value) of each RESUME_SETTINGS key that differs; both configs
    are nested dicts. A key the checkpoint's config lacks counts as unchanged."""
    changes = []
    for section, key in RESUME_SETTINGS:
        before, now = saved.get(section, {}).get(key, recipe[section][key]), recipe[section][key]
        if before != now:
            changes.append((f"{section}.{key}", before, now))
    return changes


def describe_changes(changes: list[tuple[str, object, object]]) -> str:
    return ", ".join(f"{key} {before} in the checkpoint, {now} in the recipe" for key, before, now in changes)


def resume_settings_applied(optimizer: torch.optim.Optimizer, scheduler, saved: dict, recipe: dict, *,
                            policy: str | None) -> str | None:
    """After the scheduler's state is restored (its step count and the checkpoint's base rates):
    put the rate, betas and weight decay of `policy` into the optimizer and the scheduler. Returns
    the line to log (the rate the next update uses under each side), None when nothing changed.

    The scheduler is a LambdaLR over lr_at(step) / lr: rate = base_lr x factor(step), so the base
    rates and the factor must both come from the side that wins (a checkpoint's base rates with a
    recipe's factor would be the old peak times the new shape)."""
    changes = resume_changes(saved, recipe)
    if not changes:
        return None
    if policy is None:                  # run/inputs.py refused it before start-up
        raise ValueError(resume_change_refusal(changes))
    step = scheduler.last_epoch                           # updates taken (skipped steps excluded)
    before, after = Schedule.of(saved), Schedule.of(recipe)
    wins = after if policy == "recipe" else before
    side = recipe if policy == "recipe" else saved
    scheduler.base_lrs = [wins.lr] * len(optimizer.param_groups)
    scheduler.lr_lambdas = [lambda s, w=wins: w.lr_at(s) / w.lr] * len(optimizer.param_groups)
    for i, group in enumerate(optimizer.param_groups):
        group["initial_lr"], group["lr"] = wins.lr, wins.lr_at(step)
        group["betas"] = (side["optim"]["beta1"], side["optim"]["beta2"])
        if i == 0:                                          # param_groups(): decayed, then 1-D
            group["weight_decay"] = side["optim"]["weight_decay"]
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]   # as LRScheduler.step
    return (f"optim.on_resume_change={policy}: {describe_changes(changes)}; the next update (optimizer "
            f"step {step + 1} of the schedule) uses lr {wins.lr_at(step):.3e}; the checkpoint's "
            f"schedule gives {before.lr_at(step):.3e}, the recipe's {after.lr_at(step):.3e}")


def resume_change_refusal(changes: list[tuple[str, object, object]]) -> str:
    return (f"the recipe's optimizer settings differ from the checkpoint's: {describe_changes(changes)}; "
            "set optim.on_resume_change=recipe (the recipe's schedule and settings from the resumed "
            "step) or optim.on_resume_change=checkpoint (the saved ones) (docs/checkpoints.md)")
