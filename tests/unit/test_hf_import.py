"""load_hf_state_dict: Hugging Face Llama folders (safetensors, sharded, pytorch bin) -> our names,
and the checks that refuse a folder of another shape or an unsupported Llama variant."""

import json

import pytest
import torch

from tsp_trainer.checkpoint.hf import from_hf_name, load_hf_state_dict, to_hf_name
from tsp_trainer.config import model_config

TINY = model_config("tiny")     # h=64, 2 layers, 4 heads / 2 KV heads, I=128, vocab 1024


def _hf_folder(path, cfg=TINY, **config_changes):
    """Save a random LlamaForCausalLM of `cfg`'s shape (plus any raw config changes) to `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                         intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                         max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
                         rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
                         tie_word_embeddings=cfg.tie_embeddings)
    torch.manual_seed(0)
    model = LlamaForCausalLM(hf_cfg)
    model.save_pretrained(str(path))
    if config_changes:
        raw = json.loads((path / "config.json").read_text())
        raw.update(config_changes)
        (path / "config.json").write_text(json.dumps(raw))
    return model.state_dict()


def test_names_map_one_to_one():
    assert to_hf_name("layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert to_hf_name("lm_head.weight") == "lm_head.weight"
    assert from_hf_name("model.norm.weight") == "norm.weight"


@pytest.mark.parametrize("tied", [False, True])
def test_safetensors_folder_loads_in_our_names(tmp_path, tied):
    cfg = TINY.replace(tie_embeddings=tied)
    hf = _hf_folder(tmp_path, cfg)
    ours = load_hf_state_dict(tmp_path, cfg)
    for hf_name, tensor in hf.items():
        assert torch.equal(ours[from_hf_name(hf_name)], tensor), hf_name
    if tied:     # transformers saves the tied matrix once; both of our names get it
        assert torch.equal(ours["lm_head.weight"], ours["embed_tokens.weight"])


def test_sharded_safetensors_and_pytorch_bin(tmp_path):
    from transformers import LlamaForCausalLM

    hf = _hf_folder(tmp_path / "a")
    LlamaForCausalLM.from_pretrained(str(tmp_path / "a")).save_pretrained(str(tmp_path / "b"),
                                                                            max_shard_size="100KB")
    assert (tmp_path / "b" / "model.safetensors.index.json").exists()
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
    torch.save(hf, tmp_path / "c" / "pytorch_model.bin")
    for folder in ("b", "c"):
        ours = load_hf_state_dict(tmp_path / folder, TINY)
        assert all(torch.equal(ours[from_hf_name(k)], v) for k, v in hf.items()), folder


def test_mismatching_config_names_the_field(tmp_path):
    _hf_folder(tmp_path, TINY.replace(hidden_size=128))
    with pytest.raises(ValueError) as err:
        load_hf_state_dict(tmp_path, TINY)
    assert f"model.hidden_size=64 but {tmp_path / 'config.json'} has hidden_size=128" in str(err.value)


@pytest.mark.parametrize("change,message", [
    ({"num_key_value_heads": 4}, "model.num_kv_heads=2 but"),
    ({"rms_norm_eps": 1e-6}, "model.norm_eps=1e-05 but"),
    ({"tie_word_embeddings": True}, "model.tie_embeddings=false but"),
    ({"model_type": "mistral"}, "model.family='llama' but"),
    ({"model_type": "gemma"}, "model_type='gemma'; tsp_trainer imports 'llama', 'mistral', 'qwen2'"),
    ({"attention_bias": True}, "model.qkv_bias=false but"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
     "rope_type='dynamic'; tsp_trainer supports default, linear, llama3, yarn"),
])
def test_config_checks(tmp_path, change, message):
    _hf_folder(tmp_path, **change)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        load_hf_state_dict(tmp_path, TINY)


@pytest.mark.parametrize("change,message", [
    ({"max_position_embeddings": 4096}, "max_seq_len: 4096 -> 1024"),
    ({"rope_theta": 500000.0, "rope_parameters": None}, "rope_theta: 500000.0 -> 10000.0"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
     "rope_scaling: RopeScaling(rope_type='linear'"),
])
def test_other_rope_or_context_only_warns(tmp_path, change, message):
    """Training with another RoPE or context than the source model's is how a context is
    extended (model.rope_* / max_seq_len override the folder's): a warning, not an error."""
    _hf_folder(tmp_path, **change)
    with pytest.warns(UserWarning, match=message.replace("(", r"\(")):
        load_hf_state_dict(tmp_path, TINY)


def test_missing_pieces(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_hf_state_dict(tmp_path, TINY)
    _hf_folder(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    with pytest.raises(ValueError, match="has no weights"):
        load_hf_state_dict(tmp_path, TINY)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "elsewhere.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.down_proj.weight'\]"):
        load_hf_state_dict(tmp_path, TINY)
