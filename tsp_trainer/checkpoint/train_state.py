"""What a checkpoint holds of a training run besides the layout-free model and optimizer shards
(checkpoint/reshard.py), and whether a checkpoint fits this run:

    meta.json            TrainState (step, tokens seen, skipped steps), the layout, the run's
                         identity, the model config and the resolved YAML config
    ranks/rank_XXXXX.pt  this rank's data-loader position, LR scheduler and RNG generators
                         (torch, Python, NumPy; CUDA: this process's own device only), as
                         tensors, numbers, strings and plain containers (pack_rank_state), read
                         with torch.load(weights_only=True) only (checkpoint/rank_file.py)

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


# ranks/rank_XXXXX.pt's "format": what checkpoint/rank_file.py reads (the loader, scheduler and RNG
# states as tensors, numbers, strings and plain containers: no numpy array, no class).
RANK_STATE_FORMAT = 2
# Integer lists at least this long (the loader's token buffer and replay windows) are saved as int32
# (else int64) tensors: torch.load(weights_only=True) unpickles each list item in Python (~4 us),
# a tensor is one record.
_PACK_MIN_LEN = 16


def rank_state(*, loader, scheduler, device: torch.device) -> dict:
    """This rank's ranks/rank_XXXXX.pt: data-loader position, LR scheduler, RNG generators."""
    return pack_rank_state(loader.state_dict(), scheduler.state_dict(), {
        "torch": torch.get_rng_state(), "python": random.getstate(),
        "numpy": np.random.get_state(legacy=False),
        # this process's device only: a resume may see fewer GPUs (one per task)
        "cuda": torch.cuda.get_rng_state() if device.type == "cuda" else None})


def pack_rank_state(loader_state: dict, scheduler_state: dict, rng: dict) -> dict:
    """The saved form of a rank's state. `rng`: the generators' own states (torch's tensor,
    random.getstate()'s tuple, np.random.get_state(legacy=False)'s dict, CUDA's tensor or None)."""
    version, mt, gauss = rng["python"]
    numpy_rng = rng["numpy"]
    return {"format": RANK_STATE_FORMAT, "loader": ints_as_tensors(loader_state),
            "scheduler": ints_as_tensors(scheduler_state),
            "rng": {"torch": rng["torch"], "cuda": rng["cuda"],
                    "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64),
                               "gauss": gauss},
                    "numpy": {"bit_generator": str(numpy_rng["bit_generator"]),
                              "key": torch.from_numpy(np.asarray(numpy_rng["state"]["key"], dtype=np.int64)),
                              "pos": int(numpy_rng["state"]["pos"]),
                              "has_gauss": int(numpy_rng["has_gauss"]),
                              "gauss": float(numpy_rng["gauss"])}}}


def ints_as_tensors(value):
    """Long lists of ints -> int32 / int64 tensors, recursively (the loader and scheduler states hold no
    tensors of their own, so tensors_as_ints undoes exactly this)."""
    if isinstance(value, dict):
        return {k: ints_as_tensors(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(ints_as_tensors(v) for v in value)
    if isinstance(value, list):
        if len(value) >= _PACK_MIN_LEN and all(type(v) is int for v in value):
            low, high = min(value), max(value)
            for dtype in (torch.int32, torch.int64):      # token ids: 4 bytes each
                if torch.iinfo(dtype).min <= low and high <= torch.iinfo(dtype).max:
                    return torch.tensor(value, dtype=dtype)
        return [ints_as_tensors(v) for v in value]
    return value


def tensors_as_ints(value):
    """ints_as_tensors undone: every tensor back to (nested) lists of Python ints."""
    if isinstance(value, dict):
        return {k: tensors_as_ints(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(tensors_as_ints(v) for v in value)
    if isinstance(value, list):
        return [tensors_as_ints(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return value


def restore_rank_state(saved: dict, *, loader, scheduler, optimizer, on_layout_change: str) -> None:
    """Put a saved rank's state (pack_rank_state's form) back: loader position, LR scheduler (and
    the rate the next update uses), RNG generators."""
    loader.load_state_dict(tensors_as_ints(saved["loader"]),
                           on_layout_change=_LOADER_LAYOUT_POLICY[on_layout_change])
    scheduler.load_state_dict(tensors_as_ints(saved["scheduler"]))
    reshard.apply_scheduler_lr(optimizer, scheduler)
    restore_rng(saved["rng"])


def saved_config(meta: dict) -> dict:
    """The resolved config a checkpoint was saved with, as a nested dict ({} when it holds none)."""
    import yaml

    return yaml.safe_load(meta.get("config_yaml") or "null") or {}


def restore_rng(rng: dict) -> None:
    torch.set_rng_state(rng["torch"])
    python = rng["python"]
    random.setstate((python["version"], tuple(python["state"].tolist()), python["gauss"]))
    numpy_rng = rng["numpy"]
    np.random.set_state({"bit_generator": numpy_rng["bit_generator"],
                         "state": {"key": numpy_rng["key"].numpy().astype(np.uint32),
                                   "pos": numpy_rng["pos"]},
                         "has_gauss": numpy_rng["has_gauss"], "gauss": numpy_rng["gauss"]})
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
