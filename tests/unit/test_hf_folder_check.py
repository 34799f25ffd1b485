"""A model.init_from folder whose tensors are not what its config.json says is refused by the
one-process input check (run/inputs.py), in one line naming the first mismatching tensor with the
shape config.json implies and the one found: a Qwen3 relabelled as llama (its q/k norms are
extra), a head_dim deleted by hand (q_proj of another shape), a missing lm_head."""

from __future__ import annotations

import json
import re

import pytest

from tests.helpers import hf_shapes
from tsp_trainer.checkpoint.hf import check_folder_tensors
from tsp_trainer.config.hf_model import model_config_from_hf


def _edit_config(folder, **changes):
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    path.write_text(json.dumps(raw))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("folders")
    for shape in ("qwen3", "llama_head_dim"):
        hf_shapes.save_tiny(root / shape, shape)
    return root


def _copy(saved, shape, tmp_path):
    import shutil

    return shutil.copytree(saved / shape, tmp_path / shape)


def test_a_matching_folder_passes(saved):
    for shape in ("qwen3", "llama_head_dim"):
        check_folder_tensors(saved / shape, model_config_from_hf(saved / shape))


def test_qwen3_relabelled_as_llama_names_its_q_norm(saved, tmp_path):
    folder = _copy(saved, "qwen3", tmp_path)
    _edit_config(folder, model_type="llama", architectures=["LlamaForCausalLM"])
    with pytest.raises(ValueError) as err:
        check_folder_tensors(folder, model_config_from_hf(folder))
    assert re.match(re.escape(f"model.init_from={str(folder)!r}: tensor ")
                    + r"model.layers.0.self_attn.[qk]_norm.weight \(16,\): expected none, ", str(err.value))
    assert "\n" not in str(err.value)


def test_deleted_head_dim_names_q_proj_expected_vs_found(saved, tmp_path):
    folder = _copy(saved, "llama_head_dim", tmp_path)
    _edit_config(folder, head_dim=None)
    with pytest.raises(ValueError) as err:
        check_folder_tensors(folder, model_config_from_hf(folder))
    assert "tensor model.layers.0.self_attn.q_proj.weight: expected (64, 64) from its config.json" in str(err.value)
    assert str(err.value).endswith("found (96, 64)")


def test_missing_lm_head_is_named(saved, tmp_path):
    folder = _copy(saved, "llama_head_dim", tmp_path)
    _edit_config(folder, tie_word_embeddings=True)
    cfg = model_config_from_hf(folder).replace(tie_embeddings=False)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"tensor lm_head.weight is missing: expected \(256, 64\)"):
        check_folder_tensors(folder, cfg)
