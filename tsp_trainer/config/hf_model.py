"""Hugging Face config.json -> ModelConfig fields, and back. Standard library only (json).

The supported families are rows of `HF_FAMILIES`: transformers' defaults for every key a config.json
may leave out (tests/unit/test_hf_families.py compares them with the installed transformers' config
classes) and what each family hard-codes. Whatever transformers' class would compute differently
and ModelConfig cannot represent is refused here, by name, in one line: another activation than SiLU,
attention dropout, partial rotary embeddings, RoPE types other than default / linear / llama3 /
yarn, Qwen2's and Qwen3's per-layer sliding windows. `head_dim` is read as given (it may differ from
hidden / heads); Qwen3's per-head q/k RMSNorm is ModelConfig.qk_norm. Mistral's sliding window
is kept as data (config/validate.py refuses a data.seq_len longer than it). A config.json asking
for custom code (`auto_map`) is refused unless its model is one of these families, whose custom
code is then ignored (check_no_remote_code): nothing from a model folder is ever executed.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tsp_trainer.config.model import ROPE_KEYS, ModelConfig, RopeScaling

CONFIG_NAME = "config.json"
DEFAULT_THETA = 10000.0                     # transformers' RotaryEmbeddingConfigMixin.default_theta


@dataclass(frozen=True)
class HFFamily:
    """One supported model_type: its CausalLM class name and the defaults of its config class."""

    architecture: str
    defaults: dict[str, Any]
    hard_coded: dict[str, bool] = field(default_factory=dict)   # ModelConfig fields fixed by the class


_COMMON = {"hidden_act": "silu", "initializer_range": 0.02, "tie_word_embeddings": False,
           "attention_dropout": 0.0, "pad_token_id": None}
HF_FAMILIES: dict[str, HFFamily] = {
    "llama": HFFamily("LlamaForCausalLM", {
        **_COMMON, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "bos_token_id": 1,
        "eos_token_id": 2, "attention_bias": False, "mlp_bias": False, "head_dim": None}),
    "mistral": HFFamily("MistralForCausalLM", {
        **_COMMON, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-6, "bos_token_id": 1,
        "eos_token_id": 2, "sliding_window": 4096, "head_dim": None},
        {"qkv_bias": False, "o_bias": False, "mlp_bias": False}),
    "qwen2": HFFamily("Qwen2ForCausalLM", {
        **_COMMON, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "bos_token_id": None,
        "eos_token_id": None, "use_sliding_window": False, "sliding_window": 4096,
        "max_window_layers": 28, "layer_types": None},
        {"qkv_bias": True, "o_bias": False, "mlp_bias": False}),
    "qwen3": HFFamily("Qwen3ForCausalLM", {
        **_COMMON, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "head_dim": 128, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "bos_token_id": None, "eos_token_id": None, "attention_bias": False,
        "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28,
        "layer_types": None}),
}

# (ModelConfig field, config.json key): the same number under two names.
NAME_MAP = [("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"),
            ("intermediate_size", "intermediate_size"), ("num_layers", "num_hidden_layers"),
            ("num_heads", "num_attention_heads"), ("num_kv_heads", "num_key_value_heads"),
            ("max_seq_len", "max_position_embeddings"), ("norm_eps", "rms_norm_eps"),
            ("tie_embeddings", "tie_word_embeddings"), ("init_std", "initializer_range")]


def config_json_path(path: str | Path, *, key: str) -> Path:
    """The config.json of a folder, or `path` itself if it is a .json file; ValueError naming `key`."""
    p = Path(path).expanduser()
    candidate = p / CONFIG_NAME if p.is_dir() else p
    if not candidate.is_file():
        what = "a folder without config.json" if p.is_dir() else "not an existing file or folder"
        raise ValueError(f"{key}={str(path)!r} is {what}; give a Hugging Face model folder or "
                         "its config.json")
    return candidate


def read_hf_config(path: str | Path, *, key: str = "model.init_from") -> tuple[dict[str, Any], Path]:
    """(raw config.json dict, its path)."""
    config_path = config_json_path(path, key=key)
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{key}: {config_path} is not readable JSON ({err})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{key}: {config_path} does not hold a JSON object")
    return raw, config_path


def model_fields_from_hf(raw: dict[str, Any], where: str | Path) -> dict[str, Any]:
    """ModelConfig keyword arguments describing the config.json dict `raw` (read from `where`);
    ValueError naming the key for anything transformers would compute differently from us."""
    model_type = raw.get("model_type")
    check_no_remote_code(raw, where)
    if model_type not in HF_FAMILIES:
        raise ValueError(f"{where} has model_type={model_type!r}; tsp_trainer imports "
                         f"{', '.join(repr(f) for f in HF_FAMILIES)} (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3)")
    family = HF_FAMILIES[model_type]
    c = {**family.defaults, **raw}
    if c.get("num_key_value_heads") is None:
        c["num_key_value_heads"] = c["num_attention_heads"]
    _refuse_unsupported(c, model_type, where)
    fields = {ours: c[theirs] for ours, theirs in NAME_MAP}
    fields["family"] = model_type
    if family.hard_coded:
        fields.update(family.hard_coded)
    else:   # llama, qwen3
        fields.update(qkv_bias=bool(c["attention_bias"]), o_bias=bool(c["attention_bias"]),
                      mlp_bias=bool(c.get("mlp_bias", False)))
    natural = c["hidden_size"] / c["num_attention_heads"]
    head_dim = c.get("head_dim")
    fields.update(head_dim=None if head_dim in (None, natural) else head_dim,
                  qk_norm=model_type == "qwen3")
    theta, scaling = _rope(c, where)
    fields.update(rope_theta=theta, rope_scaling=scaling)
    if model_type == "mistral":
        fields["sliding_window"] = c["sliding_window"]
    eos = c["eos_token_id"]
    fields.update(bos_token_id=c["bos_token_id"], pad_token_id=c["pad_token_id"],
                  eos_token_id=() if eos is None else tuple(eos) if isinstance(eos, list) else (eos,))
    for key in ("rope_theta", "norm_eps", "init_std"):
        fields[key] = float(fields[key])
    return fields


def check_no_remote_code(raw: dict[str, Any], where: str | Path) -> None:
    """A config.json whose `auto_map` names custom code (transformers' trust_remote_code): refused
    in one line, since tsp_trainer never runs code from a model folder, unless the model is a
    family we implement (model_type and every `architectures` entry ours), whose custom code is
    then ignored, with one warning per config.json."""
    auto_map = raw.get("auto_map")
    if not auto_map:
        return
    model_type, architectures = raw.get("model_type"), raw.get("architectures") or []
    family = HF_FAMILIES.get(model_type)
    classes = ", ".join(sorted({str(v) for v in (auto_map.values() if isinstance(auto_map, dict) else [auto_map])}))
    if family is None or any(a != family.architecture for a in architectures):
        ours = ", ".join(f"{f.architecture} ({name})" for name, f in HF_FAMILIES.items())
        raise ValueError(f"{where} asks for custom code (auto_map: {classes}) for model_type="
                         f"{model_type!r}, architectures={architectures}; tsp_trainer never runs "
                         f"code from a model folder and implements only {ours}")
    if str(where) not in _IGNORED_REMOTE_CODE:
        _IGNORED_REMOTE_CODE.add(str(where))
        logging.getLogger(__name__).warning(
            f"warning: {where} asks for custom code (auto_map: {classes}); it is ignored: "
            f"tsp_trainer runs its own {family.architecture} ({model_type}) and never runs code "
            "from a model folder")


_IGNORED_REMOTE_CODE: set[str] = set()     # config.json paths already warned about


def model_config_from_hf(path: str | Path, *, key: str = "model.init_from") -> ModelConfig:
    raw, config_path = read_hf_config(path, key=key)
    fields = model_fields_from_hf(raw, config_path)
    try:
        return ModelConfig(**fields)
    except ValueError as err:
        raise ValueError(f"{config_path}: {err}") from None


def _refuse_unsupported(c: dict[str, Any], model_type: str, where) -> None:
    checks = [
        ("hidden_act", c["hidden_act"], c["hidden_act"] == "silu", "silu (SwiGLU)"),
        ("attention_dropout", c["attention_dropout"], not c["attention_dropout"],
         "0 (dropout is 0 for pretraining)"),
        ("partial_rotary_factor", c.get("partial_rotary_factor"),
         c.get("partial_rotary_factor") in (None, 1, 1.0), "1.0 (RoPE on the whole head)"),
    ]
    for key, value, ok, supported in checks:
        if not ok:
            raise ValueError(f"{where} has {key}={value!r}; tsp_trainer's {model_type} supports only "
                             f"{key}={supported}")
    if model_type in ("qwen2", "qwen3"):
        window = c["sliding_window"] if c["use_sliding_window"] else None
        layer_types = c.get("layer_types") or [
            "sliding_attention" if window is not None and i >= c["max_window_layers"] else "full_attention"
            for i in range(c["num_hidden_layers"])]
        if window is not None and "sliding_attention" in layer_types:
            raise ValueError(f"{where} has use_sliding_window=true (sliding_window={window} on layers "
                             f">= max_window_layers={c['max_window_layers']}); tsp_trainer's {model_type} "
                             "represents full causal attention in every layer only: set "
                             "use_sliding_window=false")


def _rope(c: dict[str, Any], where) -> tuple[float, RopeScaling | None]:
    """(rope_theta, RopeScaling or None) from transformers 5's `rope_parameters` or the legacy
    `rope_scaling` + `rope_theta` keys, standardised as transformers' standardize_rope_params does:
    llama3 / yarn take original_max_position_embeddings from max_position_embeddings when absent,
    yarn's factor from max_position_embeddings / original_max_position_embeddings."""
    params = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    theta = params.pop("rope_theta", c.get("rope_theta", DEFAULT_THETA))
    if params.get("partial_rotary_factor") not in (None, 1, 1.0):
        raise ValueError(f"{where} has rope partial_rotary_factor={params['partial_rotary_factor']!r}; "
                         "tsp_trainer supports only RoPE on the whole head (1.0)")
    params.pop("partial_rotary_factor", None)
    legacy_type = params.pop("type", None)
    rope_type = params.pop("rope_type", legacy_type or "default")
    if rope_type == "default":
        return theta, None
    if rope_type not in ROPE_KEYS:
        raise ValueError(f"{where} has rope_type={rope_type!r}; tsp_trainer supports default, "
                         f"{', '.join(ROPE_KEYS)}")
    if rope_type in ("llama3", "yarn") and params.get("original_max_position_embeddings") is None:
        params["original_max_position_embeddings"] = c.get("original_max_position_embeddings",
                                                           c["max_position_embeddings"])
    if rope_type == "yarn" and params.get("factor") is None:
        params["factor"] = c["max_position_embeddings"] / params["original_max_position_embeddings"]
    required, optional = ROPE_KEYS[rope_type]
    known = {k: params[k] for k in required + optional if params.get(k) is not None}
    for key in ("factor", "low_freq_factor", "high_freq_factor", "attention_factor", "beta_fast",
                "beta_slow", "mscale", "mscale_all_dim"):
        if key in known:
            known[key] = float(known[key])
    try:
        return theta, RopeScaling(rope_type, **known)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


# -- export -------------------------------------------------------------------------------------
def hf_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json keys (transformers 5 format) describing `cfg` in its family's class."""
    family = HF_FAMILIES[cfg.family]
    rope = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    if cfg.rope_scaling is not None:
        rope.update(cfg.rope_scaling.to_dict())
    out = {theirs: getattr(cfg, ours) for ours, theirs in NAME_MAP}
    out.update(model_type=cfg.family, architectures=[family.architecture], hidden_act="silu",
               head_dim=cfg.head_dim, rope_parameters=rope, attention_dropout=0.0,
               bos_token_id=cfg.bos_token_id, pad_token_id=cfg.pad_token_id,
               eos_token_id=_eos_value(cfg.eos_token_id))
    if cfg.family == "llama":
        out.update(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)
    elif cfg.family == "qwen3":
        out.update(attention_bias=cfg.qkv_bias, use_sliding_window=False, sliding_window=None,
                   max_window_layers=cfg.num_layers)
    elif cfg.family == "mistral":
        out["sliding_window"] = cfg.sliding_window
    else:
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers)
    return out


def _eos_value(ids: tuple[int, ...]):
    return None if not ids else ids[0] if len(ids) == 1 else list(ids)


def is_close(a: Any, b: Any) -> bool:
    """Equality for config values: floats to 1e-9 relative (JSON round trips)."""
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(float(a), float(b), rel_tol=1e-9)
    return a == b
