"""What a checkpoint holds of a training run besides the layout-free model and optimizer shards
(checkpoint/reshard.py), and whether a checkpoint fits this run:

    meta.json            TrainState (step, tokens seen, skipped steps), the layout, the run's
                         identity, the model config and the resolved YAML config
    ranks/rank_XXXXX.pt  this rank's data-loader position, LR scheduler and RNG generators
                         (torch, Python, NumPy; CUDA: this process's own device only)

Restoring a rank's state copies values, so a resume under the same layout continues bit for bit.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tsp_trainer.checkpoint import reshard
from tsp_trainer.config import ModelConfig, TrainConfig, config_to_yaml

# data.on_layout_change -> what the loader does with a position saved under another DP degree
_LOADER_LAYOUT_POLICY = {"refuse": "error", "restart": "restart"}


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient with train.nonfinite=stop (raised before the update), too many
    skipped steps in a row, or non-finite weights at a save."""


@dataclass
class TrainState:
    step: int = 0                # optimizer steps taken
    tokens_seen: int = 0         # global tokens consumed
    skipped_steps: int = 0       # non-finite steps skipped

    @classmethod
    def from_meta(cls, meta: dict) -> TrainState:
        return cls(meta["step"], meta["tokens_seen"], meta.get("skipped_steps", 0))


def checkpoint_layout(cfg: TrainConfig, dims) -> dict:
    """meta.json's `layout`: what decides whether saved per-rank state maps 1:1 onto a run."""
    return {"scheme": cfg.parallel.scheme, "tsp_degree": dims.tsp, "dp_degree": dims.dp,
            "world_size": dims.world_size, "zero_stage": cfg.zero.stage}


def checkpoint_meta(state: TrainState, *, cfg: TrainConfig, model_cfg: ModelConfig, layout: dict,
                    run_identity: dict) -> dict:
    """meta.json of a checkpoint of `state`."""
    return {"step": state.step, "tokens_seen": state.tokens_seen, "skipped_steps": state.skipped_steps,
            "layout": layout, "run": run_identity, "model": model_cfg.to_dict(),
            "config_yaml": config_to_yaml(cfg)}


def rank_state(*, loader, scheduler, device: torch.device) -> dict:
    """This rank's ranks/rank_XXXXX.pt: data-loader position, LR scheduler, RNG generators."""
    return {"loader": loader.state_dict(), "scheduler": scheduler.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                    "numpy": np.random.get_state(),
                    # this process's device only: a resume may see fewer GPUs (one per task)
                    "cuda": torch.cuda.get_rng_state() if device.type == "cuda" else None}}


def restore_rank_state(saved: dict, *, loader, scheduler, optimizer, on_layout_change: str) -> None:
    """Put a saved rank's state back: loader position, LR scheduler (and the rate the next update
    uses), RNG generators."""
    loader.load_state_dict(saved["loader"], on_layout_change=_LOADER_LAYOUT_POLICY[on_layout_change])
    scheduler.load_state_dict(saved["scheduler"])
    reshard.apply_scheduler_lr(optimizer, scheduler)
    restore_rng(saved["rng"])


def saved_config(meta: dict) -> dict:
    """The resolved config a checkpoint was saved with, as a nested dict ({} when it holds none)."""
    import yaml

    return yaml.safe_load(meta.get("config_yaml") or "null") or {}


def restore_rng(rng: dict) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    cuda = cuda_rng_state_for_this_device(rng.get("cuda"), torch.cuda.current_device()
                                          if torch.cuda.is_available() else None)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


def cuda_rng_state_for_this_device(saved, device_index: int | None):
    """The saved CUDA generator state this process restores into its current device: the single
    state a checkpoint holds, or (checkpoints that saved every visible GPU) this device's entry.
    None when there is nothing to restore or no CUDA device here."""
    if saved is None or device_index is None:
        return None
    if isinstance(saved, (list, tuple)):
        return saved[device_index] if device_index < len(saved) else None
    return saved


def check_compatible(meta: dict, path: Path, *, model_cfg: ModelConfig, layout: dict,
                     on_layout_change: str) -> bool:
    """Raises for another model shape or a refused layout change; True if the layout is the
    saved one."""
    check_same_model(meta, model_cfg, path)
    reshard.check_layout_change(meta["layout"], layout, policy=on_layout_change, path=path)
    return not reshard.layout_changed(meta["layout"], layout)


def check_same_model(meta: dict, model_cfg: ModelConfig, path: Path) -> None:
    """The checkpoint must hold this model's shape; the message names every field that differs."""
    saved, mine = ModelConfig.from_dict(meta["model"]).to_dict(), model_cfg.to_dict()
    if saved != mine:
        diff = {k: (v, mine.get(k)) for k, v in saved.items() if mine.get(k) != v}
        raise ValueError(f"checkpoint {path} is of another model shape: "
                         + ", ".join(f"model.{k}={b} here vs {a} in the checkpoint"
                                     for k, (a, b) in diff.items()))
