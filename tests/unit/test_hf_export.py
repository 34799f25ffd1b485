"""tsp-export on hand-made checkpoints (the self-describing model shards of a D=2 layout, no
process group): the Hugging Face folder it writes, and the bad inputs it refuses without writing
anything to OUT. Real training runs are exported in tests/distributed/test_hf_interop.py."""

import json
import os
import stat
from pathlib import Path

import pytest
import torch

from tsp_trainer.checkpoint.export_cli import main as export_main
from tsp_trainer.checkpoint.hf import export_checkpoint, load_hf_state_dict, parse_size
from tsp_trainer.checkpoint.disk_format import build_manifest
from tsp_trainer.checkpoint.shards import shard_file_name, write_shard
from tsp_trainer.config import model_config
from tsp_trainer.model import Transformer
from tsp_trainer.parallel.apply import tsp_specs

TINY = model_config("tiny")
TOKENIZER = Path(__file__).resolve().parents[2] / "data" / "tokenizer"


def fake_checkpoint(folder, cfg=TINY, degree=2, seed=0, config_yaml=None):
    """A checkpoint folder as dp_rank 0 of each of `degree` TSP ranks would write its model part
    (meta.json's resolved config: `config_yaml`, none if None)."""
    model = Transformer(cfg)
    model.init_weights(seed)
    specs, state = tsp_specs(model, degree), model.state_dict()
    (folder / "model").mkdir(parents=True)
    for r in range(degree):
        write_shard(folder / "model" / shard_file_name(r, degree),
                    {n: specs[n].local(t, r) for n, t in state.items()}, specs, {"tsp": r})
    meta = {"step": 1, "model": cfg.__dict__}
    if config_yaml is not None:
        meta["config_yaml"] = config_yaml
    (folder / "meta.json").write_text(json.dumps(meta))
    (folder / "manifest.json").write_text(json.dumps(build_manifest(folder)))
    return state


def _nothing_written(out):
    return not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


@pytest.mark.parametrize("tied", [False, True])
def test_export_round_trips_and_splits(tmp_path, tied):
    cfg = TINY.replace(tie_embeddings=tied)
    state = fake_checkpoint(tmp_path / "ckpt", cfg)
    out = export_checkpoint(tmp_path / "ckpt", tmp_path / "hf", max_shard_size="200KB",
                            tokenizer=TOKENIZER)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((out / f).exists() for f in files)
    assert ("lm_head.weight" in index["weight_map"]) != tied      # tied: stored once, as HF does
    config = json.loads((out / "config.json").read_text())
    assert config["num_key_value_heads"] == 2 and config["tie_word_embeddings"] == tied
    assert config["eos_token_id"] is not None and (out / "tokenizer.json").exists()
    back = load_hf_state_dict(out, cfg)
    assert all(torch.equal(back[n], t) for n, t in state.items())


def test_single_file_below_the_limit_and_checkpoint_root(tmp_path):
    fake_checkpoint(tmp_path / "checkpoints" / "step_00000001")
    (tmp_path / "checkpoints" / "latest").write_text("step_00000001\n")
    out = export_checkpoint(tmp_path, tmp_path / "hf", dtype="bfloat16")      # run folder -> latest
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30
    assert parse_size("500kb") == 500_000 and parse_size(1234) == 1234 and parse_size("77") == 77
    with pytest.raises(ValueError, match="--max-shard-size"):
        parse_size("lots")


def _corrupt(kind, ckpt):
    shard = ckpt / "model" / shard_file_name(1, 2)
    if kind == "no manifest":
        (ckpt / "manifest.json").unlink()
    elif kind == "missing file":
        shard.unlink()
    elif kind == "wrong checksum":
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0xFF                                  # same size, other bytes
        shard.write_bytes(bytes(data))
    elif kind == "another shape":        # meta says h=128 but the shards hold h=64 (manifest valid)
        meta = json.loads((ckpt / "meta.json").read_text())
        meta["model"]["hidden_size"] = 128
        (ckpt / "meta.json").write_text(json.dumps(meta))
        (ckpt / "manifest.json").write_text(json.dumps(build_manifest(ckpt)))


@pytest.mark.parametrize("kind,message", [
    ("no manifest", "no manifest.json: it is incomplete or not a checkpoint"),
    ("missing file", "is missing model/model-tsp001-of-002.safetensors"),
    ("wrong checksum", "fails its sha256 check"),
    ("another shape", "is of another model shape: embed_tokens.weight has shape"),
])
def test_bad_checkpoint_is_refused_and_nothing_written(tmp_path, kind, message):
    fake_checkpoint(tmp_path / "ckpt")
    _corrupt(kind, tmp_path / "ckpt")
    with pytest.raises(ValueError, match=message):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "hf")
    assert _nothing_written(tmp_path / "hf")


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="is not a folder"):
        export_checkpoint(tmp_path / "nowhere", tmp_path / "hf")
    (tmp_path / "stuff").mkdir()
    (tmp_path / "stuff" / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="not a checkpoint"):
        export_checkpoint(tmp_path / "stuff", tmp_path / "hf")
    assert _nothing_written(tmp_path / "hf")


def test_existing_out_needs_overwrite(tmp_path):
    fake_checkpoint(tmp_path / "ckpt")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="--overwrite"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "hf")
    assert [p.name for p in (tmp_path / "hf").iterdir()] == ["keep.txt"]
    with pytest.raises(ValueError, match="--tokenizer"):          # options checked before writing
        export_checkpoint(tmp_path / "ckpt", tmp_path / "hf", tokenizer=tmp_path, overwrite=True)
    assert [p.name for p in (tmp_path / "hf").iterdir()] == ["keep.txt"]
    export_checkpoint(tmp_path / "ckpt", tmp_path / "hf", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf.")]


def test_cli(tmp_path, capsys):
    fake_checkpoint(tmp_path / "ckpt")
    export_main([str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--max-shard-size", "100KB"])
    assert "tsp-export: wrote" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        export_main([str(tmp_path / "hf"), str(tmp_path / "hf2")])      # an HF folder, not a checkpoint
    assert exit_info.value.code == 2
    assert "tsp-export: error:" in capsys.readouterr().err and _nothing_written(tmp_path / "hf2")


def test_cli_copies_the_runs_tokenizer_with_the_checkpoints_file_modes(tmp_path, capsys):
    """No --tokenizer: the one the run trained with (its resolved data.tokenizer), copied; folder
    755 and files 644 under umask 022, as a checkpoint's (not mkdtemp's 700 / safetensors' 600)."""
    fake_checkpoint(tmp_path / "ckpt", config_yaml=f"data:\n  tokenizer: {TOKENIZER}\nmodel: {{}}\n")
    previous = os.umask(0o022)
    try:
        export_main([str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--max-shard-size", "100KB"])
    finally:
        os.umask(previous)
    out = tmp_path / "hf"
    assert f"; tokenizer from {TOKENIZER}" in capsys.readouterr().out
    assert (out / "tokenizer.json").read_bytes() == (TOKENIZER / "tokenizer.json").read_bytes()
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert len(modes) > 4 and set(modes.values()) == {0o644}, modes


def test_cli_says_in_one_line_when_no_tokenizer_is_found(tmp_path, capsys):
    fake_checkpoint(tmp_path / "ckpt")                      # meta.json without a resolved config
    export_main([str(tmp_path / "ckpt"), str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert err == (f"tsp-export: no tokenizer written: checkpoint {tmp_path / 'ckpt'}: its meta.json "
                   "holds no resolved config (config_yaml); pass --tokenizer DIR to add one\n")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
