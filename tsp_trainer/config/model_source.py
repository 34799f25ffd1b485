"""Where the model and its tokenizer come from: a named size, or a Hugging Face folder
(`model.init_from`: shape + weights; `model.config_from`: shape only) plus the recipe's keys.

The rule (docs/long_context/models.md, "No hand copying"):

* With a folder, its config.json is the model. A `model.size` left in the recipe is only a check:
  its shape keys (below) must equal the folder's; its RoPE and context values are not used.
* A `model.*` key the recipe or an override sets explicitly is checked against the folder:
  - shape keys (what the weights mean: vocab_size, hidden_size, num_layers, num_heads,
    num_kv_heads, head_dim, intermediate_size, norm_eps, tie_embeddings, family, qkv_bias, o_bias,
    mlp_bias, qk_norm)
    must equal the folder's value, or it is an error naming both;
  - context keys (max_seq_len, rope_theta, rope_scaling) replace the folder's value: that is how a
    context is extended. A set `model.rope_scaling.*` replaces the folder's whole rope_scaling and
    needs `model.rope_scaling.rope_type` ('default' removes the scaling);
  - init_std replaces the folder's initializer_range (it matters for config_from only).
* The tokenizer: `data.tokenizer` if set; else the folder's (it must hold tokenizer files); else,
  with no folder, the bundled `data/tokenizer`. When `data.tokenizer` is set and the folder holds a
  tokenizer too, both must have the same vocabulary (the Trainer loads and compares them at start-up).

Standard library only: this runs in `validate_config`, before any process group exists.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from tsp_trainer.config.hf_model import NAME_MAP, config_json_path, is_close, model_config_from_hf
from tsp_trainer.config.model import MODEL_SIZES, ModelConfig, RopeScaling, model_config

DEFAULT_SIZE = "tiny"
BUNDLED_TOKENIZER = "data/tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")

SHAPE_KEYS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "intermediate_size", "norm_eps", "tie_embeddings", "family", "qkv_bias", "o_bias",
              "mlp_bias", "qk_norm")
CONTEXT_KEYS = ("max_seq_len", "rope_theta", "rope_scaling")
# Facts of a source model a recipe does not set: they come from a folder (or a named size).
FOLDER_ONLY = ("sliding_window", "bos_token_id", "eos_token_id", "pad_token_id")


def model_folder(section) -> tuple[str, str] | None:
    """(key, path) of the folder the model comes from, or None (named size)."""
    if section.init_from is not None and section.config_from is not None:
        raise ValueError(f"model.init_from={section.init_from!r} and model.config_from="
                         f"{section.config_from!r} are both set; init_from already gives the shape "
                         "(with weights), config_from the shape alone: set one")
    if section.init_from is not None:
        return "model.init_from", section.init_from
    if section.config_from is not None:
        return "model.config_from", section.config_from
    return None


def resolve_model(section) -> ModelConfig:
    """The ModelConfig a ModelSection describes (see the module docstring for the rule)."""
    explicit = section_overrides(section)
    source = model_folder(section)
    if source is None:
        return model_config(section.size or DEFAULT_SIZE, **explicit)
    key, path = source
    if key == "model.init_from" and not Path(path).expanduser().is_dir():
        raise ValueError(f"model.init_from={path!r} is not an existing folder; give a Hugging Face "
                         "model folder (config.json + safetensors) or null for a random init")
    folder_cfg = model_config_from_hf(path, key=key)
    where = config_json_path(path, key=key)
    named = model_config(section.size) if section.size is not None else None
    for name in SHAPE_KEYS:
        theirs = getattr(folder_cfg, name)
        if name in explicit and not is_close(explicit[name], theirs):
            raise ValueError(f"model.{name}={_show(explicit[name])} but {where} has "
                             f"{hf_key_of(name)}={_show(theirs)}; the folder's config.json gives "
                             f"the shape: remove model.{name} or make it agree")
        if named is not None and name not in explicit and not is_close(getattr(named, name), theirs):
            raise ValueError(f"model.size={section.size!r} has {name}={_show(getattr(named, name))} "
                             f"but {where} has {hf_key_of(name)}={_show(theirs)}; the folder's "
                             "config.json gives the shape: set model.size=null")
    changes = {k: v for k, v in explicit.items() if k not in SHAPE_KEYS}
    try:
        return folder_cfg.replace(**changes)
    except ValueError as err:
        raise ValueError(f"{err} (model from {where})") from None


def model_from_name_or_path(value: str, *, flag: str = "--model") -> ModelConfig:
    """A named size, or a Hugging Face folder / config.json path (the CLIs' --model)."""
    if value in MODEL_SIZES:
        return MODEL_SIZES[value]
    p = Path(value).expanduser()
    if not (p.is_dir() or p.is_file()):
        raise ValueError(f"{flag}={value!r} is neither a named size ({', '.join(sorted(MODEL_SIZES))}) "
                         "nor an existing Hugging Face model folder or config.json")
    return model_config_from_hf(p, key=flag)


# tsp-bench's per-dimension overrides of --model: flag -> ModelConfig field
MODEL_DIM_FLAGS = {"layers": "num_layers", "hidden": "hidden_size", "heads": "num_heads",
                   "kv_heads": "num_kv_heads", "intermediate": "intermediate_size", "vocab": "vocab_size"}


def add_model_args(parser, *, default: str, dims: bool = False) -> None:
    """The CLIs' --model (a named size or a Hugging Face folder / config.json, read by
    `model_from_name_or_path`) and, with dims, an override flag per dimension (MODEL_DIM_FLAGS)."""
    parser.add_argument("--model", default=default,
                        help=f"named size ({', '.join(MODEL_SIZES)}; default {default}) or a Hugging "
                             "Face model folder / config.json (shape only)")
    for flag, field in (MODEL_DIM_FLAGS.items() if dims else ()):
        parser.add_argument("--" + flag.replace("_", "-"), type=int, default=None,
                            help=f"override model.{field}")


def section_overrides(section) -> dict[str, Any]:
    """The ModelConfig fields a ModelSection sets explicitly (non-None), rope_scaling converted."""
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    out = {f.name: getattr(section, f.name) for f in dataclasses.fields(section)
           if f.name in names and f.name != "rope_scaling" and getattr(section, f.name) is not None}
    rope = _rope_scaling(section.rope_scaling)
    if rope is not _UNSET:
        out["rope_scaling"] = rope
    return out


_UNSET = object()


def _rope_scaling(rope_section):
    """RopeScaling, None ('default': no scaling), or _UNSET when no model.rope_scaling.* key is set."""
    values = {f.name: getattr(rope_section, f.name) for f in dataclasses.fields(rope_section)}
    given = {k: v for k, v in values.items() if v is not None}
    if not given:
        return _UNSET
    rope_type = given.pop("rope_type", None)
    if rope_type is None:
        raise ValueError(f"model.rope_scaling.{next(iter(given))} is set but model.rope_scaling."
                         "rope_type is not; name the type (linear, llama3, yarn, or default): a set "
                         "rope_scaling replaces the model's whole RoPE scaling")
    if rope_type == "default":
        if given:
            raise ValueError(f"model.rope_scaling.rope_type='default' takes no parameters (got "
                             f"model.rope_scaling.{next(iter(given))})")
        return None
    return RopeScaling(rope_type, **given)


def describe_source(section) -> str:
    """One line for the log: where the model comes from and which of the folder's context keys and
    init_std the recipe changed. A resolved config (resolve_config) spells out the folder's own
    values: a key equal to the folder's is no override."""
    source = model_folder(section)
    if source is None:
        return f"model.size={section.size or DEFAULT_SIZE}"
    key, path = source
    folder_cfg = model_config_from_hf(path, key=key)
    changed = sorted(name for name, value in section_overrides(section).items()
                     if name in CONTEXT_KEYS + ("init_std",)
                     and not is_close(value, getattr(folder_cfg, name)))
    return f"{key}={path}" + (f" (recipe overrides {', '.join(changed)})" if changed else "")


def resolve_tokenizer(data_tokenizer: str | None, section) -> str:
    """The tokenizer path or hub name to load (see the module docstring)."""
    if data_tokenizer is not None:
        return data_tokenizer
    source = model_folder(section)
    if source is None:
        return BUNDLED_TOKENIZER
    key, path = source
    folder = folder_tokenizer(path)
    if folder is None:
        raise ValueError(f"{key}={path!r} holds no tokenizer ({', '.join(TOKENIZER_FILES[:3])}, ...) "
                         "and data.tokenizer is not set; set data.tokenizer to the tokenizer this "
                         "model was trained with")
    return folder


def folder_tokenizer(path: str) -> str | None:
    """The folder of `path` (a folder or its config.json) if it holds tokenizer files."""
    p = Path(path).expanduser()
    folder = p if p.is_dir() else p.parent
    return str(folder) if any((folder / n).is_file() for n in TOKENIZER_FILES) else None


def hf_key_of(name: str) -> str:
    """How config.json says it: its own key, or our field derived from model_type/attention_bias."""
    derived = {"family": "model_type", "qkv_bias": "qkv_bias (from model_type/attention_bias)",
               "o_bias": "o_bias (from model_type/attention_bias)",
               "mlp_bias": "mlp_bias (from model_type/mlp_bias)",
               "qk_norm": "qk_norm (from model_type)"}
    return dict(NAME_MAP).get(name) or derived.get(name, name)


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else repr(value)
