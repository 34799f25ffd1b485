"""Hugging Face interop (Llama 2/3.x, Mistral, Qwen2/2.5), in one process with no process group:
export a checkpoint's model to a folder transformers' `AutoModelForCausalLM.from_pretrained` loads as
the family it was imported from (config.json + generation_config.json + safetensors, split above a
size with model.safetensors.index.json), and import such a folder as a full state dict in our names.
Must not import trainer, engine or deepspeed.

Our parameter names are Hugging Face's minus the leading "model." (`lm_head.weight` unchanged) and
RoPE uses its rotate_half convention (model/rope.py), so tensors map 1:1 with no permutation. The
config.json <-> ModelConfig mapping and what is refused live in config/hf_model.py.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import yaml
from safetensors import safe_open
from safetensors.torch import save_file

from tsp_trainer.checkpoint.disk_format import LATEST, META, read_verified_meta
from tsp_trainer.checkpoint.shards import read_full_state_dict
from tsp_trainer.config import ModelConfig, ModelSection
from tsp_trainer.config.hf_model import HF_FAMILIES, hf_config_dict, is_close, model_fields_from_hf
from tsp_trainer.config.model_source import (BUNDLED_TOKENIZER, CONTEXT_KEYS, SHAPE_KEYS, hf_key_of,
                                             resolve_tokenizer)
from tsp_trainer.model import Transformer

HF_PREFIX = "model."
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
REPO_ROOT = Path(__file__).resolve().parents[2]     # where the bundled tokenizer lives
_UNITS = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}

def to_hf_name(name: str) -> str:
    return name if name == "lm_head.weight" else HF_PREFIX + name


def from_hf_name(name: str) -> str:
    return name[len(HF_PREFIX):] if name.startswith(HF_PREFIX) else name


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our tensor names -> full shapes, in module order (lm_head.weight listed even when tied)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


# -- import -----------------------------------------------------------------------------------------
def load_hf_state_dict(path: str | os.PathLike, model_cfg: ModelConfig) -> Mapping[str, torch.Tensor]:
    """A Hugging Face Llama / Mistral / Qwen2 folder (config.json + model.safetensors, sharded
    safetensors with an index, or pytorch_model.bin) as a full state dict in our names, after
    checking that its config and tensor shapes describe `model_cfg`. Raises ValueError naming what
    does not match.

    The mapping reads each tensor from its file when it is looked up (safetensors; pytorch bin
    files are memory-mapped), so a rank that copies its slices out one parameter at a time
    (Parallelized.load_full_state_dict) never holds the whole model."""
    folder = Path(path)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"model.init_from={str(path)!r} is not a Hugging Face model folder "
                         f"(no config.json); save one with save_pretrained")
    check_hf_config(json.loads(config_path.read_text()), model_cfg, config_path)
    sources = {from_hf_name(n): src for n, src in _hf_sources(folder).items()
               if not n.endswith("rotary_emb.inv_freq")}       # a buffer older transformers saved
    if model_cfg.tie_embeddings and "embed_tokens.weight" in sources:
        sources["lm_head.weight"] = sources["embed_tokens.weight"]
    check_shapes({n: shape for n, (shape, _) in sources.items()}, model_cfg, where=str(folder),
                 name_of=to_hf_name)
    return _LazyTensors({n: read for n, (_, read) in sources.items()})


def check_folder_tensors(path: str | os.PathLike, model_cfg: ModelConfig, *,
                         key: str = "model.init_from") -> None:
    """The folder's tensor names and shapes (read from the files' headers, no tensor data) against
    those `model_cfg` (its config.json's model) implies, in module order: ValueError, one line,
    naming the first tensor that is missing, unexpected or of another shape (expected vs found).
    The input check runs it before any process group exists."""
    folder = Path(path)
    found = {from_hf_name(n): shape for n, (shape, _) in _hf_sources(folder).items()
             if not n.endswith("rotary_emb.inv_freq")}
    if model_cfg.tie_embeddings and "embed_tokens.weight" in found:
        found.setdefault("lm_head.weight", found["embed_tokens.weight"])
    expected = expected_shapes(model_cfg)
    where = f"{key}={str(path)!r}: tensor"
    implied = f"its config.json ({model_cfg.family}, {_describe(model_cfg)}, head_dim={model_cfg.head_dim})"
    for name, shape in expected.items():
        if name not in found:
            raise ValueError(f"{where} {to_hf_name(name)} is missing: expected {shape} from {implied}, "
                             "found none (the weights are of another model than config.json says)")
        if tuple(found[name]) != shape:
            raise ValueError(f"{where} {to_hf_name(name)}: expected {shape} from {implied}, found "
                             f"{tuple(found[name])}")
    extra = [n for n in found if n not in expected]
    if extra:
        raise ValueError(f"{where} {to_hf_name(extra[0])} {tuple(found[extra[0]])}: expected none, "
                         f"{implied} has no such tensor (the weights are of another model than "
                         "config.json says)")


class _LazyTensors(Mapping):
    """name -> tensor, produced by its reader on each lookup."""

    def __init__(self, readers: dict[str, Callable[[], torch.Tensor]]):
        self._readers = readers

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._readers[name]()

    def __iter__(self):
        return iter(self._readers)

    def __len__(self) -> int:
        return len(self._readers)


def check_hf_config(raw: dict, model_cfg: ModelConfig, config_path: Path) -> None:
    """The folder's config.json must describe `model_cfg`'s weights: every shape field equal
    (config/model_source.py SHAPE_KEYS), else one ValueError listing each mismatch. Variants the
    model cannot represent are refused by name (config/hf_model.py). RoPE settings and the context
    length may differ: training with another RoPE than the source model's is how a context is
    extended (docs/long_context/rope.md); that only warns."""
    folder_cfg = ModelConfig(**model_fields_from_hf(raw, config_path))
    wrong = [f"model.{k}={_show(getattr(model_cfg, k))} but {config_path} has "
             f"{hf_key_of(k)}={_show(getattr(folder_cfg, k))}"
             for k in SHAPE_KEYS if not is_close(getattr(model_cfg, k), getattr(folder_cfg, k))]
    if wrong:
        raise ValueError("; ".join(wrong) + " (set the model.* keys to the folder's values, or "
                         "leave them unset: model.init_from takes them from config.json)")
    changed = [f"{k}: {_show(getattr(folder_cfg, k))} -> {_show(getattr(model_cfg, k))}"
               for k in CONTEXT_KEYS if not is_close(getattr(model_cfg, k), getattr(folder_cfg, k))]
    if changed:
        warnings.warn(f"{config_path}: the model is trained with other RoPE / context settings than "
                      f"the source model ({'; '.join(changed)})", stacklevel=3)


def _show(value) -> str:
    return str(value).lower() if isinstance(value, bool) else repr(value)


def _hf_sources(folder: Path) -> dict[str, tuple[tuple[int, ...], Callable[[], torch.Tensor]]]:
    """HF tensor name -> (shape, reader) for whichever weight format the folder holds."""
    if (folder / INDEX_NAME).is_file():
        files = sorted(set(json.loads((folder / INDEX_NAME).read_text())["weight_map"].values()))
    elif (folder / WEIGHTS_NAME).is_file():
        files = [WEIGHTS_NAME]
    else:
        return _bin_sources(folder)
    out = {}
    for f in files:
        with safe_open(str(folder / f), framework="pt") as handle:
            for name in handle.keys():
                out[name] = (tuple(handle.get_slice(name).get_shape()),
                             functools.partial(_read_safetensor, folder / f, name))
    return out


def _read_safetensor(path: Path, name: str) -> torch.Tensor:
    with safe_open(str(path), framework="pt") as handle:
        return handle.get_tensor(name)


def _bin_sources(folder: Path) -> dict[str, tuple[tuple[int, ...], Callable[[], torch.Tensor]]]:
    if (folder / "pytorch_model.bin.index.json").is_file():
        index = json.loads((folder / "pytorch_model.bin.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
    elif (folder / "pytorch_model.bin").is_file():
        files = ["pytorch_model.bin"]
    else:
        raise ValueError(f"{folder} has no weights: expected {WEIGHTS_NAME}, {INDEX_NAME}, "
                         "pytorch_model.bin or pytorch_model.bin.index.json")
    out = {}
    for f in files:      # memory-mapped: pages are read when a tensor is used
        for name, t in torch.load(folder / f, map_location="cpu", weights_only=True, mmap=True).items():
            out[name] = (tuple(t.shape), functools.partial(_identity, t))
    return out


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def check_shapes(shapes: dict[str, tuple[int, ...]], cfg: ModelConfig, *, where: str,
                 name_of=lambda name: name) -> None:
    """`shapes` (our names -> shape) must be exactly the model's tensors with its shapes."""
    expected = expected_shapes(cfg)
    missing = [name_of(n) for n in expected if n not in shapes]
    unexpected = [name_of(n) for n in shapes if n not in expected]
    if missing or unexpected:
        raise ValueError(f"{where} does not hold this model's tensors: missing {missing[:4]}"
                         f"{' ...' if len(missing) > 4 else ''}, unexpected {unexpected[:4]}"
                         f"{' ...' if len(unexpected) > 4 else ''}")
    for name, shape in expected.items():
        if tuple(shapes[name]) != shape:
            raise ValueError(f"{where} is of another model shape: {name_of(name)} has shape "
                             f"{tuple(shapes[name])}, the model config implies {shape} "
                             f"({_describe(cfg)})")


def _describe(cfg: ModelConfig) -> str:
    return (f"vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size}, "
            f"intermediate_size={cfg.intermediate_size}, num_layers={cfg.num_layers}, "
            f"num_heads={cfg.num_heads}, num_kv_heads={cfg.num_kv_heads}")


# -- export -----------------------------------------------------------------------------------------
def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A step_* folder as given; a checkpoints root or a run folder resolves through `latest`."""
    path = Path(path)
    for root in (path, path / "checkpoints"):
        if (root / LATEST).is_file():
            return root / (root / LATEST).read_text().strip()
    return path


def export_checkpoint(checkpoint: str | os.PathLike, out: str | os.PathLike, *,
                      max_shard_size: int | str = "5GB", tokenizer: str | os.PathLike | None = None,
                      dtype: str | None = None, overwrite: bool = False) -> Path:
    """Consolidate a checkpoint saved under any layout into a Hugging Face folder `out` of the
    model's family (a Qwen2 stays a Qwen2). Everything is checked (manifest, shapes, options)
    before anything is written, and the folder is written under a temporary name next to `out` and
    renamed at the end."""
    folder = resolve_checkpoint(checkpoint)
    meta = read_verified_meta(folder)
    try:
        cfg = ModelConfig.from_dict(meta["model"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"checkpoint {folder}: meta.json has no usable model config ({err})") from err
    full = read_full_state_dict(folder / "model")
    check_shapes({n: tuple(t.shape) for n, t in full.items()}, cfg, where=f"checkpoint {folder}")
    return save_hf_folder(full, cfg, out, max_shard_size=max_shard_size, tokenizer=tokenizer,
                          dtype=dtype, overwrite=overwrite)


def run_tokenizer(checkpoint: str | os.PathLike) -> tuple[Path | None, str]:
    """The tokenizer the checkpoint's run trained with, as tsp-train resolved it from the config
    saved in meta.json (data.tokenizer, else the model.init_from / config_from folder's, else the
    bundled one): (its local folder or tokenizer.json, "") or (None, why it is not here)."""
    folder = resolve_checkpoint(checkpoint)
    try:
        saved = yaml.safe_load(json.loads((folder / META).read_text()).get("config_yaml") or "null")
    except (OSError, ValueError, yaml.YAMLError) as err:
        return None, f"checkpoint {folder} has no readable {META} ({err})"
    if not isinstance(saved, dict):
        return None, f"checkpoint {folder}: its {META} holds no resolved config (config_yaml)"
    data, model = saved.get("data") or {}, saved.get("model") or {}
    section = ModelSection(init_from=model.get("init_from"), config_from=model.get("config_from"))
    try:
        source = resolve_tokenizer(data.get("tokenizer"), section)
    except ValueError as err:
        return None, str(err)
    path = Path(source).expanduser()
    if not path.exists() and source == BUNDLED_TOKENIZER:
        path = REPO_ROOT / BUNDLED_TOKENIZER
    if not path.exists():
        return None, (f"the run's tokenizer {source!r} is not a local file or folder here (a Hub "
                      "name, or moved)")
    if path.is_dir() and not any((path / n).is_file() for n in TOKENIZER_FILES):
        return None, f"the run's tokenizer folder {path} holds none of {', '.join(TOKENIZER_FILES[:3])}, ..."
    return path, ""


def save_hf_folder(full: dict[str, torch.Tensor], cfg: ModelConfig, out: str | os.PathLike, *,
                   max_shard_size: int | str = "5GB", tokenizer: str | os.PathLike | None = None,
                   dtype: str | None = None, overwrite: bool = False) -> Path:
    """Write a full state dict (our names) as a Hugging Face folder of cfg.family, atomically:
    weights, config.json, generation_config.json (bos/eos/pad) and the tokenizer files. Token ids
    come from the model config (an imported folder's) and, where it has none, from the tokenizer."""
    out = Path(out)
    limit = parse_size(max_shard_size)
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype={dtype!r}; use one of {sorted(DTYPES)}")
    tok_files = tokenizer_files(tokenizer) if tokenizer is not None else []
    if out.exists() and not (out.is_dir() and not any(out.iterdir())) and not overwrite:
        raise ValueError(f"{out} already exists and is not empty; pass --overwrite to replace it")
    tensors = {to_hf_name(n): (full[n] if dtype is None else full[n].to(DTYPES[dtype]))
               for n in expected_shapes(cfg) if not (cfg.tie_embeddings and n == "lm_head.weight")}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        _write_weights(tensors, tmp, limit)
        cfg = with_token_ids(cfg, _special_token_ids(tok_files))
        for f in tok_files:
            shutil.copy2(f, tmp / f.name)
        dtype_name = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
        config = hf_config(cfg, dtype=dtype_name)
        config.save_pretrained(str(tmp))
        if any(i is not None for i in (cfg.bos_token_id, cfg.pad_token_id)) or cfg.eos_token_id:
            from transformers import GenerationConfig

            GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=config.eos_token_id,
                             pad_token_id=cfg.pad_token_id).save_pretrained(str(tmp))
        follow_umask(tmp)
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def hf_config(cfg: ModelConfig, *, dtype: str = "float32"):
    """The transformers config (LlamaConfig, MistralConfig or Qwen2Config, by cfg.family)
    describing `cfg`: biases, RoPE type and parameters, sliding window, token ids."""
    from transformers import AutoConfig

    values = hf_config_dict(cfg)
    return AutoConfig.for_model(values.pop("model_type"), **values, dtype=dtype)


def hf_model_class(cfg: ModelConfig):
    """transformers' CausalLM class of cfg.family (LlamaForCausalLM, ...)."""
    import transformers

    return getattr(transformers, HF_FAMILIES[cfg.family].architecture)


def with_token_ids(cfg: ModelConfig, from_tokenizer: dict[str, int]) -> ModelConfig:
    """cfg with the tokenizer's bos/eos/pad ids filled in where cfg (an imported config.json)
    has none; the imported ids win (they are what the source model's generation config uses)."""
    changes = {}
    for kind in ("bos", "pad"):
        if getattr(cfg, f"{kind}_token_id") is None and f"{kind}_token_id" in from_tokenizer:
            changes[f"{kind}_token_id"] = from_tokenizer[f"{kind}_token_id"]
    if not cfg.eos_token_id and "eos_token_id" in from_tokenizer:
        changes["eos_token_id"] = (from_tokenizer["eos_token_id"],)
    return cfg.replace(**changes) if changes else cfg


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as "5GB", "500MB", "2GiB" (decimal and binary units)."""
    if isinstance(size, int) and size > 0:
        return size
    text = str(size).strip().upper()
    for unit, factor in _UNITS.items():
        if text.endswith(unit) and text[:-len(unit)].strip().replace(".", "", 1).isdigit():
            value = int(float(text[:-len(unit)]) * factor)
            if value > 0:
                return value
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise ValueError(f"--max-shard-size={size!r}: use a positive size such as 5GB, 500MB or 2GiB")


def tokenizer_files(source: str | os.PathLike) -> list[Path]:
    """The tokenizer files to copy: those of TOKENIZER_FILES in a folder, or one tokenizer.json."""
    source = Path(source)
    if source.is_file():
        return [source]
    files = [source / n for n in TOKENIZER_FILES if (source / n).is_file()]
    if not files:
        raise ValueError(f"--tokenizer {source} holds none of the tokenizer files "
                         f"{', '.join(TOKENIZER_FILES[:3])}, ...")
    return files


def follow_umask(folder: Path) -> None:
    """Give `folder` and the files in it the modes of a plain mkdir / open under the umask, as the
    checkpoints have (755 / 644 under umask 022): mkdtemp makes the folder 0700 and safetensors
    writes its files 0600."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for f in folder.iterdir():
        if f.is_file():
            os.chmod(f, 0o666 & ~umask)


def _special_token_ids(files: list[Path]) -> dict[str, int]:
    """bos/eos/pad ids for config.json, from tokenizer_config.json's tokens and tokenizer.json."""
    by_name = {f.name: f for f in files}
    if "tokenizer_config.json" not in by_name or "tokenizer.json" not in by_name:
        return {}
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(by_name["tokenizer.json"]))
    config = json.loads(by_name["tokenizer_config.json"].read_text())
    ids = {}
    for kind in ("bos", "eos", "pad"):
        token = config.get(f"{kind}_token")
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str) and tok.token_to_id(token) is not None:
            ids[f"{kind}_token_id"] = tok.token_to_id(token)
    return ids


def _write_weights(tensors: dict[str, torch.Tensor], folder: Path, limit: int) -> None:
    """One model.safetensors, or model-0000i-of-0000n.safetensors + index when over `limit`
    (a tensor larger than the limit gets a file of its own, as transformers does)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        # contiguous copies: safetensors refuses views and shared storage
        shards[-1][name] = t.detach().to("cpu").contiguous().clone()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        for key, t in shard.items():
            weight_map[key] = name
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _publish(tmp: Path, out: Path) -> None:
    """Rename the finished folder into place; an old `out` is moved aside first, removed last."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
        os.rename(out, old / out.name)
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
