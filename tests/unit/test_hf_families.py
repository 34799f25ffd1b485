"""Model families (Llama 2 / 3.x, Mistral, Qwen2 / 2.5) and RoPE scaling against the installed
transformers: config.json parsing and its defaults, what is refused by name, the cos/sin tables
(bit for bit) and the logits (rtol 1e-5 / atol 1e-6, fp32) of tiny random models saved with
save_pretrained, at positions past the original context, and export back to the same family."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tests.helpers.hf_models import LLAMA31_8B, MISTRAL_7B_V03, QWEN25_7B, tiny_hf
from tsp_trainer.checkpoint.hf import load_hf_state_dict, save_hf_folder
from tsp_trainer.config.hf_model import HF_FAMILIES, model_config_from_hf, model_fields_from_hf
from tsp_trainer.config.model import MODEL_SIZES, ModelConfig, RopeScaling
from tsp_trainer.model import Transformer, rope_cos_sin

TOL = dict(rtol=1e-5, atol=1e-6)

@pytest.mark.parametrize("family", sorted(HF_FAMILIES))
def test_family_defaults_are_the_installed_transformers_defaults(family):
    """The defaults a config.json may leave out are transformers' own (a newer transformers that
    changed one makes this fail instead of silently importing another model)."""
    import transformers

    cls = getattr(transformers, HF_FAMILIES[family].architecture.replace("ForCausalLM", "Config"))
    theirs = {f.name: f.default for f in dataclasses.fields(cls)}
    for key, value in HF_FAMILIES[family].defaults.items():
        assert key in theirs and theirs[key] == value, (family, key, value, theirs.get(key))
    assert cls.default_theta == 10000.0


@pytest.mark.parametrize("raw,size", [(LLAMA31_8B, "llama3_8b"), (QWEN25_7B, "qwen2_5_7b"),
                                      (MISTRAL_7B_V03, "mistral_7b")])
def test_released_configs_parse_to_the_named_shapes(raw, size):
    """The named shapes are the released models' config.json, token ids aside."""
    cfg = ModelConfig(**model_fields_from_hf(dict(raw), "config.json"))
    assert cfg.replace(bos_token_id=None, eos_token_id=(), pad_token_id=None) == MODEL_SIZES[size]
    assert cfg.bos_token_id == raw["bos_token_id"] and cfg.eos_token_id == (raw["eos_token_id"],)


def test_named_shapes_have_the_published_parameter_counts():
    with torch.device("meta"):
        for size, count in (("llama3_8b", 8_030_261_248), ("qwen2_5_7b", 7_615_616_512),
                            ("mistral_7b", 7_248_023_552)):
            model = Transformer(MODEL_SIZES[size])
            assert sum(p.numel() for p in model.parameters()) == count == MODEL_SIZES[size].num_params()


@pytest.mark.parametrize("raw", [LLAMA31_8B, QWEN25_7B, MISTRAL_7B_V03])
def test_rope_parameters_equal_transformers_standardised_ones(raw):
    """Our reading of rope_theta / rope_scaling (legacy or rope_parameters) is the dict
    transformers' config class standardises the same file to."""
    from transformers import AutoConfig

    values = {k: v for k, v in raw.items() if k != "model_type"}
    theirs = AutoConfig.for_model(raw["model_type"], **values).rope_parameters
    cfg = ModelConfig(**model_fields_from_hf(dict(raw), "config.json"))
    ours = {"rope_type": "default", "rope_theta": cfg.rope_theta,
            **(cfg.rope_scaling.to_dict() if cfg.rope_scaling else {})}
    assert ours == theirs


@pytest.mark.parametrize("change,message", [
    ({"hidden_act": "gelu"}, "has hidden_act='gelu'; tsp_trainer's llama supports only hidden_act=silu"),
    ({"attention_dropout": 0.1}, "has attention_dropout=0.1"),
    ({"partial_rotary_factor": 0.5}, "has partial_rotary_factor=0.5"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}},
     "has rope_type='longrope'"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "has rope_type='dynamic'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                       "high_freq_factor": 1.0}}, "high_freq_factor=1.0 must be above"),
    ({"model_type": "phi3"}, "has model_type='phi3'"),
])
def test_what_transformers_would_compute_differently_is_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        model_fields_from_hf({**LLAMA31_8B, **change}, "config.json")
    assert "\n" not in str(err.value)


def test_qwen2_sliding_window_layers_are_refused_unless_off():
    on = {**QWEN25_7B, "use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 20}
    with pytest.raises(ValueError, match="use_sliding_window=true .*max_window_layers=20"):
        model_fields_from_hf(on, "config.json")
    # every layer below max_window_layers: no layer slides, the same model as without a window
    assert model_fields_from_hf({**on, "max_window_layers": 28}, "c")["family"] == "qwen2"


def test_yarn_defaults_are_resolved_as_transformers_does():
    raw = {**MISTRAL_7B_V03, "max_position_embeddings": 131072,
           "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}, "rope_theta": None}
    fields = model_fields_from_hf(raw, "c")
    # original = max_position_embeddings (standardize_rope_params), factor = max / original
    assert fields["rope_scaling"] == RopeScaling("yarn", factor=1.0, original_max_position_embeddings=131072)
    assert fields["rope_theta"] == 1e6


# ---------------------------------------------------------------------------------------------
# RoPE tables


SCALINGS = {
    "default": None,
    "linear": RopeScaling("linear", factor=4.0),
    "llama3": RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64),
    "yarn": RopeScaling("yarn", factor=4.0, original_max_position_embeddings=64),
    "yarn_params": RopeScaling("yarn", factor=8.0, original_max_position_embeddings=64, beta_fast=16.0,
                               beta_slow=2.0, truncate=False, mscale=0.707, mscale_all_dim=1.0),
    "yarn_attention_factor": RopeScaling("yarn", factor=4.0, original_max_position_embeddings=64,
                                         attention_factor=1.25),
}


@pytest.mark.parametrize("name", sorted(SCALINGS))
@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_rope_tables_equal_transformers_bit_for_bit(name, theta):
    """cos/sin at positions 0..1023 (16 x the 64-token original context) equal transformers'
    LlamaRotaryEmbedding exactly, and a zigzag rank's positions get the same rows."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    scaling = SCALINGS[name]
    rope = {"rope_type": "default"} if scaling is None else scaling.to_dict()
    hf_cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=1024,
                         rope_parameters={**rope, "rope_theta": theta})
    positions = torch.arange(1024)
    cos_hf, sin_hf = LlamaRotaryEmbedding(hf_cfg)(torch.zeros(1), positions[None])
    cos, sin = rope_cos_sin(positions, 64, theta, scaling)
    assert torch.equal(cos, cos_hf[0]) and torch.equal(sin, sin_hf[0])
    zigzag = torch.cat([torch.arange(128, 256), torch.arange(768, 896)])     # rank 1 of D = 4
    cos_z, sin_z = rope_cos_sin(zigzag, 64, theta, scaling)
    assert torch.equal(cos_z, cos[zigzag]) and torch.equal(sin_z, sin[zigzag])


# ---------------------------------------------------------------------------------------------
# Tiny models of every family against transformers


FAMILY_CASES = {
    # Llama 3.1 style: GQA, llama3 scaling from a 32-token original context, tied (3.2), biases
    "llama3_tied_biases": ("llama", dict(
        tie_word_embeddings=True, attention_bias=True, mlp_bias=True, eos_token_id=[2, 3],
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 32})),
    "llama2": ("llama", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "qwen2_yarn": ("qwen2", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                                  "original_max_position_embeddings": 32})),
    "mistral_linear_window": ("mistral", dict(sliding_window=128, rope_parameters={
        "rope_type": "linear", "rope_theta": 1e6, "factor": 2.0})),
}


@pytest.mark.parametrize("case", sorted(FAMILY_CASES))
def test_imported_model_logits_equal_transformers(tmp_path, case):
    """Import (config.json -> ModelConfig, weights -> our names) and compare the logits of 128
    tokens (4 x the original context of the scaled cases) with transformers' own model."""
    model_type, config = FAMILY_CASES[case]
    hf = tiny_hf(tmp_path, model_type, **config)
    cfg = model_config_from_hf(tmp_path)
    assert cfg.family == model_type
    ours = Transformer(cfg)
    ours.load_state_dict(dict(load_hf_state_dict(tmp_path, cfg)))
    ids = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, **TOL)


@pytest.mark.parametrize("case", sorted(FAMILY_CASES))
def test_export_writes_the_same_family_back(tmp_path, case):
    """Import, export (tsp_trainer.checkpoint.hf.save_hf_folder), load with AutoModelForCausalLM:
    the same class, config (RoPE, biases, window, token ids), generation_config.json and logits;
    importing the export again gives the same ModelConfig."""
    from transformers import AutoModelForCausalLM

    model_type, config = FAMILY_CASES[case]
    hf = tiny_hf(tmp_path / "src", model_type, **config)
    cfg = model_config_from_hf(tmp_path / "src")
    state = dict(load_hf_state_dict(tmp_path / "src", cfg))
    out = save_hf_folder(state, cfg, tmp_path / "out")
    back = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(back) is type(hf)
    assert model_config_from_hf(out) == cfg
    src, dst = (json.loads((p / "config.json").read_text()) for p in (tmp_path / "src", out))
    for key in ("rope_parameters", "bos_token_id", "eos_token_id", "sliding_window", "attention_bias",
                "mlp_bias", "use_sliding_window", "tie_word_embeddings"):
        assert src.get(key) == dst.get(key), key
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (src["bos_token_id"], src["eos_token_id"])
    ids = torch.randint(0, 256, (1, 96), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, hf(ids).logits, **TOL)


def test_model_config_round_trips_through_json():
    cfg = MODEL_SIZES["llama3_8b"].replace(eos_token_id=(128001, 128009), bos_token_id=128000)
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    # a checkpoint written before the families existed: the new fields take their defaults
    old = {k: v for k, v in MODEL_SIZES["tiny"].to_dict().items()
           if k not in ("family", "qkv_bias", "o_bias", "mlp_bias", "rope_scaling", "sliding_window",
                        "bos_token_id", "eos_token_id", "pad_token_id")}
    assert ModelConfig.from_dict(old) == MODEL_SIZES["tiny"]


@pytest.mark.parametrize("changes,message", [
    (dict(family="qwen2"), "model.family='qwen2' with model.qkv_bias=false"),
    (dict(family="mistral", mlp_bias=True), "transformers' mistral has no biases"),
    (dict(qkv_bias=True), "one attention_bias for q, k, v and o"),
    (dict(sliding_window=64), "model.sliding_window=64 is only represented for model.family='mistral'"),
    (dict(rope_scaling=dict(rope_type="linear", factor=2.0, low_freq_factor=1.0)),
     "model.rope_scaling.low_freq_factor=1.0 is not a parameter of rope_type 'linear'"),
    (dict(rope_scaling=dict(rope_type="yarn", factor=2.0)),
     "rope_type='yarn' needs model.rope_scaling.original_max_position_embeddings"),
    (dict(rope_scaling=dict(rope_type="linear", factor=-1.0)), "model.rope_scaling.factor=-1.0 must be"),
])
def test_family_and_rope_rules(changes, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        if "rope_scaling" in changes:
            changes = {"rope_scaling": RopeScaling(**changes["rope_scaling"])}
        MODEL_SIZES["tiny"].replace(**changes)
