"""Self-describing model shards: each rank that owns a distinct shard (dp_rank 0 of each tsp rank)
writes its local tensors to one safetensors file whose metadata records, per tensor, the full
shape and how it is split (ShardSpec). Reading every file back gives the full state dict whatever
layout wrote it, which is what resharding and export need (STYLE.md section 5.8)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tsp_trainer.parallel.apply import ShardSpec

META_KEY = "tsp_trainer.shards"


def shard_file_name(tsp_rank: int, degree: int) -> str:
    return f"model-tsp{tsp_rank:03d}-of-{degree:03d}.safetensors"


def write_shard(path: Path, tensors: dict[str, torch.Tensor], specs: dict[str, ShardSpec],
                axis_ranks: dict[str, int]) -> None:
    """Write this rank's tensors with, for each, (dim, degree, axis, this rank's index on it)."""
    layout = {name: {"dim": specs[name].dim, "degree": specs[name].degree, "axis": specs[name].axis,
                     "index": axis_ranks.get(specs[name].axis, 0)} for name in tensors}
    # safetensors refuses shared storage (tied weights): store contiguous copies.
    data = {name: t.detach().to("cpu").contiguous().clone() for name, t in tensors.items()}
    save_file(data, str(path), metadata={META_KEY: json.dumps(layout)})


def read_full_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """Assemble full tensors from every shard file in `folder`."""
    files = sorted(folder.glob("model-*.safetensors"))
    if not files:
        raise ValueError(f"{folder} holds no model-*.safetensors shard files")
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    layouts: dict[str, dict] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            layout = json.loads(handle.metadata()[META_KEY])
            for name in handle.keys():
                layouts[name] = layout[name]
                pieces.setdefault(name, {})[layout[name]["index"]] = handle.get_tensor(name)
    return {name: _assemble(name, layouts[name], parts) for name, parts in pieces.items()}


def _assemble(name: str, layout: dict, parts: dict[int, torch.Tensor]) -> torch.Tensor:
    if layout["dim"] is None:
        return parts[min(parts)]
    missing = sorted(set(range(layout["degree"])) - set(parts))
    if missing:
        raise ValueError(f"checkpoint is missing shards {missing} of {name!r} "
                         f"(split {layout['degree']} ways along dim {layout['dim']})")
    return torch.cat([parts[i] for i in range(layout["degree"])], dim=layout["dim"])
