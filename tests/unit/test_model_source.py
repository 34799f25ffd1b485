"""No hand copying: model.init_from / model.config_from give the model section from config.json
and the tokenizer from the folder, under the rule of config/model_source.py (shape keys must
agree, context keys override); named shapes; the CLIs' --model taking a folder or config.json.
All of it runs before any process group exists."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers.hf_models import QWEN25_7B
from tsp_trainer.bench.cli import build_parser as bench_parser
from tsp_trainer.bench.cli import spec_from_args
from tsp_trainer.config import load_config, validate_config
from tsp_trainer.config.model import MODEL_SIZES, RopeScaling
from tsp_trainer.data import load_run_tokenizer

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "data" / "tokenizer"
# A tiny Qwen2 (q/k/v biases, 256 positions) whose tokenizer is the bundled one (vocab 1024).
TINY_QWEN2 = {"model_type": "qwen2", "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
              "bos_token_id": 5, "eos_token_id": 6}


def _folder(path: Path, raw=TINY_QWEN2, tokenizer: bool = True) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))
    if tokenizer:
        for f in TOKENIZER.iterdir():
            shutil.copy(f, path / f.name)
    return path


def _cfg(*overrides):
    return load_config(None, ["data.seq_len=128", "train.steps=20", *overrides])


def _error(fn, *args) -> str:
    with pytest.raises(ValueError) as info:
        fn(*args)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_config_from_gives_model_and_tokenizer(tmp_path):
    folder = _folder(tmp_path / "qwen")
    cfg = _cfg(f"model.config_from={folder}")
    validate_config(cfg, world_size=1)
    model = cfg.model.to_model_config()
    assert (model.family, model.qkv_bias, model.hidden_size, model.rope_theta, model.max_seq_len) == \
        ("qwen2", True, 64, 1e6, 256)
    assert (model.bos_token_id, model.eos_token_id) == (5, (6,))
    assert cfg.tokenizer_source() == str(folder)
    # a config.json path works too, and gives the same model
    assert _cfg(f"model.config_from={folder / 'config.json'}").model.to_model_config() == model


def test_without_a_folder_the_bundled_tokenizer_and_tiny(tmp_path):
    cfg = _cfg()
    assert cfg.data.tokenizer is None and cfg.tokenizer_source() == "data/tokenizer"
    assert cfg.model.to_model_config() == MODEL_SIZES["tiny"]


def test_shape_keys_must_agree_naming_both(tmp_path):
    folder = _folder(tmp_path / "qwen")
    message = _error(validate_config, _cfg(f"model.config_from={folder}", "model.hidden_size=128"))
    assert f"model.hidden_size=128 but {folder / 'config.json'} has hidden_size=64" in message
    message = _error(validate_config, _cfg(f"model.config_from={folder}", "model.qkv_bias=false"))
    assert "model.qkv_bias=false but" in message and "qkv_bias (from model_type/attention_bias)=true" in message
    validate_config(_cfg(f"model.config_from={folder}", "model.num_layers=2", "model.family=qwen2"))


def test_a_named_size_left_in_the_recipe_is_checked(tmp_path):
    folder = _folder(tmp_path / "qwen")
    message = _error(validate_config, _cfg(f"model.config_from={folder}", "model.size=tiny"))
    assert (f"model.size='tiny' has norm_eps=1e-05 but {folder / 'config.json'} has rms_norm_eps=1e-06"
            in message and "set model.size=null" in message)
    llama = _folder(tmp_path / "llama", {**TINY_QWEN2, "model_type": "llama", "num_key_value_heads": 2,
                                         "rms_norm_eps": 1e-5, "max_position_embeddings": 1024})
    assert _cfg(f"model.config_from={llama}", "model.size=tiny").model.to_model_config().rope_theta == 1e6


def test_context_keys_override_the_folder(tmp_path):
    folder = _folder(tmp_path / "qwen")
    cfg = _cfg(f"model.config_from={folder}", "model.max_seq_len=1024", "model.rope_theta=2e6",
               "model.rope_scaling.rope_type=yarn", "model.rope_scaling.factor=4",
               "model.rope_scaling.original_max_position_embeddings=256", "data.seq_len=1024")
    validate_config(cfg, world_size=1)
    model = cfg.model.to_model_config()
    assert (model.max_seq_len, model.rope_theta) == (1024, 2e6)
    assert model.rope_scaling == RopeScaling("yarn", factor=4.0, original_max_position_embeddings=256)
    # rope_type=default removes a folder's scaling
    scaled = _folder(tmp_path / "scaled", {**TINY_QWEN2, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    assert _cfg(f"model.config_from={scaled}").model.to_model_config().rope_scaling == RopeScaling("linear", factor=2.0)
    assert _cfg(f"model.config_from={scaled}", "model.rope_scaling.rope_type=default").model.to_model_config().rope_scaling is None


def test_the_log_line_names_only_what_the_recipe_changed(tmp_path):
    """describe_source runs on the resolved config, which spells out the folder's max_seq_len,
    rope_theta and init_std: those are no override; a value other than the folder's is."""
    from tsp_trainer.config import resolve_config
    from tsp_trainer.config.model_source import describe_source

    folder = _folder(tmp_path / "qwen")
    plain = resolve_config(_cfg(f"model.init_from={folder}"), world_size=1, cuda=False)
    assert plain.model.max_seq_len == 256 and plain.model.rope_theta == 1e6    # filled in
    assert describe_source(plain.model) == f"model.init_from={folder}"
    changed = resolve_config(_cfg(f"model.init_from={folder}", "model.rope_theta=2e6",
                                  "model.max_seq_len=256", "model.rope_scaling.rope_type=linear",
                                  "model.rope_scaling.factor=2"), world_size=1, cuda=False)
    assert describe_source(changed.model) == (f"model.init_from={folder} (recipe overrides "
                                              "rope_scaling, rope_theta)")
    assert describe_source(_cfg().model) == "model.size=tiny"


@pytest.mark.parametrize("overrides,message", [
    (["model.rope_scaling.factor=4"], "model.rope_scaling.factor is set but model.rope_scaling.rope_type is not"),
    (["model.rope_scaling.rope_type=default", "model.rope_scaling.factor=2"],
     "rope_type='default' takes no parameters"),
    (["model.rope_scaling.rope_type=llama3", "model.rope_scaling.factor=8"],
     "rope_type='llama3' needs model.rope_scaling.low_freq_factor, model.rope_scaling.high_freq_factor"),
    (["model.init_from=/nowhere", "model.config_from=/elsewhere"], "are both set"),
    (["model.init_from=/nowhere"], "model.init_from='/nowhere' is not an existing folder"),
    (["model.config_from=/nowhere"], "model.config_from='/nowhere' is not an existing file or folder"),
])
def test_bad_model_sources_fail_in_validation(overrides, message):
    assert message in _error(validate_config, _cfg(*overrides))


def test_loader_refuses_an_unknown_rope_type():
    assert "model.rope_scaling.rope_type'='dynamic' must be one of 'default', 'linear', 'llama3', 'yarn'" in \
        _error(load_config, None, ["model.rope_scaling.rope_type=dynamic"])


def test_a_sliding_window_shorter_than_seq_len_is_refused(tmp_path):
    raw = {**TINY_QWEN2, "model_type": "mistral", "sliding_window": 64}
    folder = _folder(tmp_path / "mistral", raw)
    validate_config(_cfg(f"model.config_from={folder}", "data.seq_len=64"))
    assert ("data.seq_len=128 exceeds the model's sliding_window=64 (mistral)"
            in _error(validate_config, _cfg(f"model.config_from={folder}")))
    raw["sliding_window"] = None
    validate_config(_cfg(f"model.config_from={_folder(tmp_path / 'm2', raw)}"))


def test_tokenizer_rules(tmp_path):
    bare = _folder(tmp_path / "bare", tokenizer=False)
    assert "holds no tokenizer" in _error(validate_config, _cfg(f"model.config_from={bare}"))
    validate_config(_cfg(f"model.config_from={bare}", f"data.tokenizer={TOKENIZER}"))
    folder = _folder(tmp_path / "qwen")
    cfg = _cfg(f"model.config_from={folder}")
    assert load_run_tokenizer(cfg.data.tokenizer, cfg.model).name == str(folder / "tokenizer.json")
    # data.tokenizer set too: a copy of the same tokenizer passes, another one is an error
    copy = _folder(tmp_path / "copy")
    load_run_tokenizer(str(copy), cfg.model)
    other = tmp_path / "other"
    other.mkdir()
    tok = json.loads((TOKENIZER / "tokenizer.json").read_text())
    vocab, added = tok["model"]["vocab"], {t["content"] for t in tok["added_tokens"]}
    plain = sorted((t for t in vocab if t not in added), key=vocab.get)
    for token, new_id in zip(plain, reversed([vocab[t] for t in plain])):
        vocab[token] = new_id                                # same size and eos, other ids
    (other / "tokenizer.json").write_text(json.dumps(tok))
    shutil.copy(TOKENIZER / "tokenizer_config.json", other)
    message = _error(load_run_tokenizer, str(other), cfg.model)
    assert f"data.tokenizer='{other / 'tokenizer.json'}' and the tokenizer of model.config_from" in message


def test_plan_and_bench_take_a_folder_or_config_json(tmp_path, capsys):
    from tsp_trainer.plan.cli import main as plan_main

    folder = _folder(tmp_path / "qwen25", QWEN25_7B, tokenizer=False)
    assert plan_main(["--model", str(folder / "config.json"), "--seq-len", "32768", "--global-batch",
                      "16", "--gpu", "h100", "--schemes", "tsp", "--json", str(tmp_path / "p.json")]) == 0
    assert f"{folder / 'config.json'} at 32768 tokens" in capsys.readouterr().out
    layouts = json.loads((tmp_path / "p.json").read_text())["fitting"]
    # Qwen2.5-7B has 28 query heads: TSP degrees 2 and 4 fit an H100 (1, plain DP, too), 8 does not divide them
    degrees = {r["layout"]["degree"] for r in layouts}
    assert {2, 4} <= degrees and 8 not in degrees
    assert "does not divide model.num_heads=28" in json.loads((tmp_path / "p.json").read_text())["rejected"]["tsp D=8"]
    args = bench_parser().parse_args(["--model", str(folder), "--layers", "2", "--hidden", "112",
                                      "--vocab", "1024", "--intermediate", "256", "--seq-len", "64",
                                      "--degree", "2", "--schemes", "tsp,sp"])
    spec = spec_from_args(args)
    assert (spec.model.family, spec.model.qkv_bias, spec.model.num_kv_heads) == ("qwen2", True, 4)
    with pytest.raises(SystemExit):
        plan_main(["--model", str(tmp_path / "nothing"), "--global-batch", "8"])
    assert "is neither a named size" in capsys.readouterr().err
