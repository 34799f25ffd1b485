"""D = 1 of tests/distributed/test_hf_shapes.py, and the config side of Qwen3 and an explicit
head_dim: each tiny transformers folder (Qwen3, Llama / Mistral with head_dim != hidden / heads)
imports to logits, loss, gradients, document-masked gradients and 3 AdamW steps equal to
transformers' own; export writes the same family back; the named qwen3_8b shape is Qwen3-8B's
config.json; head_dim and qk_norm round-trip through ModelConfig and the recipe keys."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import hf_shapes
from tsp_trainer.checkpoint.hf import load_hf_state_dict, save_hf_folder
from tsp_trainer.config.hf_model import model_config_from_hf, model_fields_from_hf
from tsp_trainer.config.model import MODEL_SIZES, ModelConfig
from tsp_trainer.model import Transformer
from tsp_trainer.model.documents import Documents
from tsp_trainer.model.rope import PositionRuns

TOL = dict(rtol=1e-5, atol=1e-6)

# Qwen3-8B's config.json as published (the keys that describe the model)
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936}


def test_qwen3_8b_config_parses_to_the_named_shape():
    cfg = ModelConfig(**model_fields_from_hf(dict(QWEN3_8B), "config.json"))
    assert cfg.replace(bos_token_id=None, eos_token_id=()) == MODEL_SIZES["qwen3_8b"]
    with torch.device("meta"):
        model = Transformer(cfg)
    # 8.19B parameters (Qwen3-8B's model card: 8.2B), the closed form too
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params() == 8_190_735_360


def test_explicit_head_dim_is_kept_and_a_derived_one_follows_the_shape():
    cfg = ModelConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=24)
    assert (cfg.head_dim, cfg.q_hidden_size, cfg.kv_hidden_size) == (24, 96, 48)
    assert cfg.replace(hidden_size=128).head_dim == 24
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    tiny = MODEL_SIZES["tiny"]
    assert tiny.to_dict()["head_dim"] is None and tiny.replace(hidden_size=128).head_dim == 32
    # an old checkpoint's meta.json (no head_dim, no qk_norm) reads back to the same model
    old = {k: v for k, v in tiny.to_dict().items() if k not in ("head_dim", "qk_norm")}
    assert ModelConfig.from_dict(old) == tiny
    with torch.device("meta"):
        model = Transformer(cfg)
    assert model.layers[0].self_attn.q_proj.weight.shape == (96, 64)
    assert model.layers[0].self_attn.o_proj.weight.shape == (64, 96)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()


@pytest.mark.parametrize("changes,message", [
    (dict(head_dim=7), "head_dim=7 .* must be even"),
    (dict(head_dim=0), "model.head_dim=0 must be a positive integer"),
    (dict(family="qwen3"), "model.family='qwen3' with model.qk_norm=false"),
    (dict(qk_norm=True), "model.family='llama' with model.qk_norm=true"),
    (dict(family="qwen3", qk_norm=True, mlp_bias=True), "transformers' qwen3 has one attention_bias"),
])
def test_qwen3_and_head_dim_rules(changes, message):
    with pytest.raises(ValueError, match=message):
        MODEL_SIZES["tiny"].replace(**changes)


def test_hidden_not_divisible_by_heads_needs_an_explicit_head_dim():
    with pytest.raises(ValueError, match="divisible by model.num_heads=3 .or set model.head_dim"):
        ModelConfig(hidden_size=64, num_heads=3, num_kv_heads=1)
    assert ModelConfig(hidden_size=64, num_heads=3, num_kv_heads=1, head_dim=16).q_hidden_size == 48


def test_qwen3_sliding_window_layers_are_refused_unless_off():
    on = {**QWEN3_8B, "use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 20}
    with pytest.raises(ValueError, match="use_sliding_window=true .*tsp_trainer's qwen3"):
        model_fields_from_hf(on, "config.json")


@pytest.mark.parametrize("shape", sorted(hf_shapes.SHAPES))
def test_shape_at_d1_equals_transformers(tmp_path, shape):
    """Import: logits, loss and gradients; document masking; 3 AdamW steps; export back to the
    same family (transformers' logits of the exported trained weights are ours)."""
    from transformers import AutoModelForCausalLM

    src = hf_shapes.saved(shape)
    cfg = model_config_from_hf(src)
    ids, labels = hf_shapes.batch(cfg.vocab_size)
    ref = hf_shapes.shared_reference(shape)
    ours = Transformer(cfg)
    ours.load_state_dict(dict(load_hf_state_dict(src, cfg)))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), ref["logits"], **TOL)
    loss = ours.loss(ids, labels)
    loss.backward()
    assert loss.item() == pytest.approx(ref["loss"], rel=1e-6)
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, ref["grads"][name], **TOL, msg=lambda m: f"{name}: {m}")
    ours.zero_grad()
    docs = Documents.from_lengths(hf_shapes.DOC_LENGTHS, reset_positions=True)
    s, c = ours.loss_sum(ids, labels, PositionRuns.contiguous(ids.shape[1]).with_documents(docs))
    (s / c).backward()
    assert (s / c).item() == pytest.approx(ref["doc_loss"], rel=1e-6)
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, ref["doc_grads"][name], **TOL, msg=lambda m: f"docs {name}: {m}")
    ours.zero_grad()
    opt = torch.optim.AdamW(ours.parameters(), lr=hf_shapes.LR, eps=hf_shapes.EPS)
    for _ in range(hf_shapes.STEPS):
        ours.loss(ids, labels).backward()
        opt.step()
        opt.zero_grad()
    trained = {k: v.detach() for k, v in ours.state_dict().items()}
    for name, w in ref["weights"].items():
        torch.testing.assert_close(trained[name], w, rtol=0, atol=3e-6, msg=lambda m: f"AdamW {name}: {m}")
    out = save_hf_folder(trained, cfg, tmp_path / "out")
    back = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    src, dst = (json.loads((p / "config.json").read_text()) for p in (src, out))
    for key in ("model_type", "attention_bias", "tie_word_embeddings", "num_key_value_heads"):
        assert src.get(key) == dst.get(key), key
    # head_dim: written explicitly, equal to the source's (Qwen2's config leaves it derived)
    assert dst["head_dim"] == src.get("head_dim", src["hidden_size"] // src["num_attention_heads"])
    assert model_config_from_hf(out) == cfg
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ours(ids), **TOL)
