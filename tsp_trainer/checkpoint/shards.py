"""Self-describing model shards: each rank that owns a distinct shard (dp_rank 0 of each tsp rank)
writes its local tensors to one safetensors file whose metadata records, per tensor, the full
shape and how it is split (ShardSpec). Reading every file back gives the full state dict whatever
layout wrote it, which is what resharding and export need: the file names are never the only
record of the layout.

The same format holds the layout-free optimizer state (checkpoint/reshard.py): files
`optim-tspXXX-of-YYY[-partPPP-of-QQQ].safetensors`, tensors named "<state key>/<parameter name>".
A part suffix splits one model-parallel rank's tensors by name over several files (the dp ranks
of its group each write one part); readers index tensors by name, so any split reads back.

Files are written by `save_safetensors`, a streaming writer of the safetensors format (8-byte
header length, JSON header, raw little-endian tensor bytes): it writes each tensor's bytes straight
from its memory (no second copy of the whole file, as safetensors' save_file makes), releases the
GIL while writing and hashing (a background checkpoint thread then barely slows training), and
returns the file's sha256 computed in the same pass (the manifest needs no second read).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from tsp_trainer.parallel.apply import ShardSpec

META_KEY = "tsp_trainer.shards"
EXTRA_KEY = "tsp_trainer.extra"


# torch dtype -> safetensors dtype tag
_DTYPE_TAGS = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
               torch.uint8: "U8", torch.bool: "BOOL"}


def shard_file_name(tsp_rank: int, degree: int, prefix: str = "model", *, part: int = 0,
                    parts: int = 1) -> str:
    suffix = f"-part{part:03d}-of-{parts:03d}" if parts > 1 else ""
    return f"{prefix}-tsp{tsp_rank:03d}-of-{degree:03d}{suffix}.safetensors"


def shard_layout(names, specs: dict[str, ShardSpec], axis_ranks: dict[str, int]) -> dict[str, dict]:
    """For each tensor name (optionally "<state key>/<param>"), its (dim, degree, axis, index), and
    its full length along dim ("size") when the blocks are padded (the vocabulary rows)."""
    out = {}
    for name in names:
        spec = specs[name.rsplit("/", 1)[-1]] if name not in specs else specs[name]
        # a block held by several ranks (K/V head copies) is written by each under its block index
        out[name] = {"dim": spec.dim, "degree": spec.degree, "axis": spec.axis,
                     "index": spec.block(axis_ranks.get(spec.axis, 0))}
        if spec.size is not None:
            out[name]["size"] = spec.size
    return out


def write_shard(path: Path, tensors: dict[str, torch.Tensor], specs: dict[str, ShardSpec],
                axis_ranks: dict[str, int], *, extra: dict | None = None) -> dict:
    """Write this rank's tensors with, for each, (dim, degree, axis, this rank's index on it).
    `extra`: JSON-able facts stored beside the layout (e.g. the optimizer's step count).
    Returns {"bytes", "sha256"} of the file."""
    return write_layout_file(path, tensors, shard_layout(tensors, specs, axis_ranks), extra=extra)


def write_layout_file(path: Path, tensors: dict[str, torch.Tensor], layout: dict[str, dict], *,
                      extra: dict | None = None) -> dict:
    metadata = {META_KEY: json.dumps(layout)}
    if extra is not None:
        metadata[EXTRA_KEY] = json.dumps(extra)
    return save_safetensors(path, tensors, metadata)


def save_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> dict:
    """Write `tensors` (any device; copied to host one at a time if needed) as a safetensors file,
    fsynced; returns {"bytes", "sha256"} computed while writing."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPE_TAGS[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)          # the format aligns the data start to 8 bytes
    digest, size = hashlib.sha256(), 0
    with open(path, "wb") as f:
        chunks = itertools.chain([struct.pack("<Q", len(raw)), raw], map(_raw_bytes, tensors.values()))
        for chunk in chunks:                # one tensor at a time (a GPU tensor is copied lazily)
            f.write(chunk)                  # both release the GIL on large buffers
            digest.update(chunk)
            size += len(chunk)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": size, "sha256": digest.hexdigest()}


def _raw_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes in row-major order, without a copy when it is a contiguous host tensor
    (tied weights sharing storage are each written in full, as safetensors requires)."""
    t = t.detach().to("cpu").contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def read_extra(folder: Path, prefix: str = "model") -> dict:
    """The `extra` dict of the first shard file (every file of one save carries the same)."""
    with safe_open(str(_shard_files(folder, prefix)[0]), framework="pt") as handle:
        return json.loads((handle.metadata() or {}).get(EXTRA_KEY, "{}"))


def read_full_state_dict(folder: Path, prefix: str = "model") -> dict[str, torch.Tensor]:
    """Assemble full tensors from every shard file in `folder`."""
    files = _shard_files(folder, prefix)
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
    full = torch.cat([parts[i] for i in range(layout["degree"])], dim=layout["dim"])
    return full.narrow(layout["dim"], 0, layout["size"]) if "size" in layout else full


def read_local_state_dict(folder: Path, specs: dict[str, ShardSpec], rank_of_axis: dict[str, int],
                          names: list[str], prefix: str = "model") -> dict[str, torch.Tensor]:
    """This rank's slice (under `specs`, the new layout) of each tensor in `names`, reading only the
    stored pieces that overlap it: no rank holds a full tensor when old and new layouts split the
    same dim (resharding D -> D'). `specs` is keyed by parameter name; a stored name may carry a
    "<state key>/" prefix (optimizer shards)."""
    index = _index(folder, prefix)
    out = {}
    for name in names:
        if name not in index:
            raise ValueError(f"{folder} has no tensor {name!r} in its {prefix}-*.safetensors shards")
        layout, parts = index[name]
        new = specs[name.rsplit("/", 1)[-1]]
        rank = rank_of_axis.get(new.axis, 0)     # on the axis: local() and blocks take block(rank)
        if layout["dim"] is None:       # replicated: every copy is the same, read one
            out[name] = new.local(_get(parts[min(parts)], name), rank)
        elif new.dim == layout["dim"]:
            out[name] = _read_overlap(name, layout, parts, new.degree, new.block(rank))
        else:                           # split along another dim: go through the full tensor
            full = _assemble(name, layout, {i: _get(f, name) for i, f in parts.items()})
            out[name] = new.local(full, rank)
    return out


def _shard_files(folder: Path, prefix: str) -> list[Path]:
    files = sorted(Path(folder).glob(f"{prefix}-*.safetensors"))
    if not files:
        raise ValueError(f"{folder} holds no {prefix}-*.safetensors shard files")
    return files


def _index(folder: Path, prefix: str) -> dict[str, tuple[dict, dict[int, Path]]]:
    """name -> (layout, {index on its axis: file})."""
    index: dict[str, tuple[dict, dict[int, Path]]] = {}
    for f in _shard_files(folder, prefix):
        with safe_open(str(f), framework="pt") as handle:
            layout = json.loads(handle.metadata()[META_KEY])
            for name in handle.keys():
                index.setdefault(name, (layout[name], {}))[1][layout[name]["index"]] = f
    return index


def _get(path: Path, name: str) -> torch.Tensor:
    with safe_open(str(path), framework="pt") as handle:
        return handle.get_tensor(name)


def _read_overlap(name: str, layout: dict, parts: dict[int, Path], degree: int, rank: int) -> torch.Tensor:
    """Block `rank` of `degree` along layout["dim"], cut from the stored blocks that overlap it."""
    dim, old_degree = layout["dim"], layout["degree"]
    missing = sorted(set(range(old_degree)) - set(parts))
    if missing:
        raise ValueError(f"checkpoint is missing shards {missing} of {name!r} "
                         f"(split {old_degree} ways along dim {dim})")
    with safe_open(str(parts[0]), framework="pt") as handle:
        old_len = handle.get_slice(name).get_shape()[dim]
    # the true length (the stored blocks may end in padding rows); the new blocks are padded again
    full_len = layout.get("size", old_len * old_degree)
    new_len = -(-full_len // degree)
    start, stop = rank * new_len, min((rank + 1) * new_len, full_len)
    pieces = []
    for i in range(start // old_len, (stop - 1) // old_len + 1) if stop > start else ():
        lo, hi = max(start, i * old_len) - i * old_len, min(stop, (i + 1) * old_len) - i * old_len
        with safe_open(str(parts[i]), framework="pt") as handle:
            pieces.append(handle.get_slice(name)[(slice(None),) * dim + (slice(lo, hi),)])
    block = torch.cat(pieces, dim=dim) if pieces else None
    short = new_len - max(stop - start, 0)
    if short:                                    # padding rows past the true length: zeros
        with safe_open(str(parts[0]), framework="pt") as handle:
            like = handle.get_slice(name)[(slice(None),) * dim + (slice(0, 1),)]
        shape = list(like.shape)
        shape[dim] = short
        zeros = like.new_zeros(shape)
        block = zeros if block is None else torch.cat([block, zeros], dim=dim)
    return block
