"""Nothing runs from a file we load: a rank state file is read as plain data only (a pickle naming
any other class or function is refused by name, and nothing from it runs), the older format is
converted only by `tsp-train convert-checkpoint`, the package holds no pickle / weights_only=False /
eval, and a model folder asking for custom code is refused or has it ignored."""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from tsp_trainer.checkpoint.convert import convert_checkpoint
from tsp_trainer.checkpoint.disk_format import atomic_torch_save, build_manifest, verify_manifest
from tsp_trainer.checkpoint.fallback import check_rank_states_before_resume
from tsp_trainer.checkpoint.rank_file import RankStateRefused, check_rank_states, read_rank_state
from tsp_trainer.checkpoint.train_state import (RANK_STATE_FORMAT, tensors_as_ints, pack_rank_state,
                                                restore_rng)
from tsp_trainer.config.hf_model import HF_FAMILIES, model_fields_from_hf
from tests.helpers.hf_models import LLAMA31_8B

PACKAGE = Path(__file__).resolve().parents[2] / "tsp_trainer"


class _CreatesAFile:
    """Unpickling this creates `path`: the attack a rank state must never carry out."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def _loader_state():
    return {"version": 2, "dp_rank": 0, "token_buffer": list(range(100, 400)), "shuffle": False,
            "replay": [[list(range(7)), list(range(50, 90))]], "source": "data/corpus",
            "documents": {"kind": "single", "stream": {"block_state": None, "epoch": (0, 1)}},
            "offsets": [2**40 + i for i in range(20)], "huge": [2**70] * 20, "flags": [True] * 20}


def _live_rng():
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": np.random.get_state(legacy=False), "cuda": None}


def _draws():
    return torch.rand(3).tolist(), random.random(), float(np.random.rand())


def _checkpoint(tmp_path, state_of_rank) -> Path:
    """A step folder with two rank state files (and a manifest that matches them)."""
    folder = tmp_path / "checkpoints" / "step_00000004"
    (folder / "ranks").mkdir(parents=True)
    for rank in range(2):
        atomic_torch_save(state_of_rank(rank), folder / "ranks" / f"rank_{rank:05d}.pt")
    (folder / "meta.json").write_text("{}")
    (folder / "manifest.json").write_text(json.dumps(build_manifest(folder)))
    return folder


def _replace_with_attack(folder: Path, rel: str, sentinel: Path, *, as_torch_zip: bool, protocol=2):
    """Replace a rank state by a pickle that creates `sentinel` when loaded; manifest updated."""
    if as_torch_zip:
        buffer = io.BytesIO()
        torch.save({"loader": _CreatesAFile(sentinel)}, buffer)
        data = buffer.getvalue()
    else:
        data = pickle.dumps({"loader": _CreatesAFile(sentinel)}, protocol=protocol)
    (folder / rel).write_bytes(data)
    (folder / "manifest.json").write_text(json.dumps(build_manifest(folder)))
    assert verify_manifest(folder) is None          # the sha256 check proves nothing here


def test_a_rank_state_round_trips_as_plain_data(tmp_path):
    np.random.seed(3)
    random.seed(4)
    torch.manual_seed(5)
    scheduler = {"base_lrs": [0.003], "last_epoch": 2, "lr_lambdas": [None], "_is_initial": False}
    packed = pack_rank_state(_loader_state(), scheduler, _live_rng())
    expected = _draws()
    atomic_torch_save(packed, tmp_path / "rank_00000.pt")
    saved = read_rank_state(tmp_path / "rank_00000.pt")
    assert saved["format"] == RANK_STATE_FORMAT
    assert saved["loader"]["token_buffer"].dtype == torch.int32          # one record, not 300 items
    assert saved["loader"]["offsets"].dtype == torch.int64 and isinstance(saved["loader"]["huge"], list)
    assert tensors_as_ints(saved["loader"]) == _loader_state()
    assert tensors_as_ints(saved["scheduler"]) == scheduler
    restore_rng(saved["rng"])
    assert _draws() == expected                     # every generator continues where it was


@pytest.mark.parametrize("how", ["torch_zip", "protocol_0", "protocol_2", "protocol_5"])
def test_a_rank_state_that_runs_code_is_refused_by_name(tmp_path, how):
    sentinel = tmp_path / "created_by_the_pickle"
    folder = _checkpoint(tmp_path, lambda rank: pack_rank_state({}, {}, _live_rng()))
    _replace_with_attack(folder, "ranks/rank_00001.pt", sentinel, as_torch_zip=how == "torch_zip",
                         protocol=int(how[-1]) if how != "torch_zip" else 2)
    with pytest.raises(RankStateRefused) as err:
        check_rank_states(folder)
    assert str(folder / "ranks" / "rank_00001.pt") in str(err.value)
    assert f"{os.system.__module__}.system" in str(err.value) and err.value.older_format is False
    assert not sentinel.exists()


def test_unreadable_and_foreign_data_are_refused(tmp_path):
    path = tmp_path / "rank_00000.pt"
    path.write_bytes(b"not a pickle at all")
    with pytest.raises(RankStateRefused, match="not a readable rank state"):
        read_rank_state(path)
    atomic_torch_save({"format": 1, "loader": {}}, path)
    with pytest.raises(RankStateRefused, match="not a tsp_trainer rank state of format 2"):
        read_rank_state(path)
    atomic_torch_save({"format": 2, "size": torch.Size([2])}, path)    # torch allows it; we do not
    with pytest.raises(RankStateRefused, match="needs torch.Size"):
        read_rank_state(path)


def test_under_auto_a_refused_checkpoint_is_set_aside_and_named(tmp_path):
    sentinel = tmp_path / "created_by_the_pickle"
    folder = _checkpoint(tmp_path, lambda rank: pack_rank_state({}, {}, _live_rng()))
    _replace_with_attack(folder, "ranks/rank_00000.pt", sentinel, as_torch_zip=False)
    with pytest.raises(ValueError) as err:
        check_rank_states_before_resume(folder, resume="'" + str(folder) + "'")
    assert folder.is_dir() and "rank_00000.pt" in str(err.value)        # an explicit path stays
    with pytest.raises(ValueError) as err:
        check_rank_states_before_resume(folder, resume="auto")
    line = str(err.value)
    assert line.startswith("train.resume=auto: checkpoint file ") and "\n" not in line
    assert "rank_00000.pt" in line and ".system" in line and "damaged" in line
    assert not folder.exists() and (folder.parent / "damaged" / "step_00000004").is_dir()
    assert not sentinel.exists()


def _older_format(rank):
    """What the earlier writer saved: the NumPy RNG state as np.random.get_state()'s tuple."""
    return {"loader": {**_loader_state(), "dp_rank": rank}, "scheduler": {"last_epoch": 4},
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                    "numpy": np.random.get_state(), "cuda": None}}


def test_an_older_checkpoint_is_refused_with_the_conversion_then_converted(tmp_path):
    np.random.seed(11)
    random.seed(12)
    torch.manual_seed(13)
    folder = _checkpoint(tmp_path, _older_format)
    expected = _draws()
    with pytest.raises(ValueError) as err:
        check_rank_states_before_resume(folder, resume="auto")
    assert f"run `tsp-train convert-checkpoint {folder}` once" in str(err.value)
    assert "numpy.ndarray" in str(err.value) and folder.is_dir()      # not moved: convertible
    shard = folder / "model.bin"
    shard.write_bytes(b"weights")
    (folder / "manifest.json").write_text(json.dumps(build_manifest(folder)))

    assert convert_checkpoint(folder) == 2
    assert verify_manifest(folder) is None and shard.read_bytes() == b"weights"
    assert check_rank_states(folder) == 2
    saved = read_rank_state(folder / "ranks" / "rank_00001.pt")
    assert tensors_as_ints(saved["loader"]) == {**_loader_state(), "dp_rank": 1}
    restore_rng(saved["rng"])
    assert _draws() == expected
    assert convert_checkpoint(folder) == 0                           # already converted
    assert sorted(p.name for p in folder.parent.iterdir()) == ["step_00000004"]


def test_conversion_refuses_a_file_that_runs_code(tmp_path):
    sentinel = tmp_path / "created_by_the_pickle"
    folder = _checkpoint(tmp_path, _older_format)
    _replace_with_attack(folder, "ranks/rank_00001.pt", sentinel, as_torch_zip=True)
    with pytest.raises(ValueError, match=r"rank_00001\.pt needs .*system.*nothing converted"):
        convert_checkpoint(folder)
    assert not sentinel.exists()
    (folder / "ranks" / "rank_00000.pt").write_bytes(b"changed")
    with pytest.raises(ValueError, match="only a checkpoint that verifies is converted"):
        convert_checkpoint(folder)


# What the package must never do to data from disk or the network, and the one place allowed:
# tools/launch.py's fork launcher passes each forked worker's result back to its own parent
# through a multiprocessing queue (pickle between processes it started itself).
FORBIDDEN = {"pickle": re.compile(r"^\s*(import pickle\b|from pickle import)|\bpickle\.(loads?|Unpickler)\b"
                                  r"|\b(cloudpickle|dill|joblib|marshal|shelve)\b", re.MULTILINE),
             "weights_only=False": re.compile(r"weights_only\s*=\s*False"),
             "eval/exec": re.compile(r"(?<![\w.])(eval|exec)\s*\("),
             "unsafe YAML": re.compile(r"yaml\.(unsafe_)?load\s*\((?![^)]*SafeLoader)|yaml\.Loader\b"),
             "allow_pickle": re.compile(r"allow_pickle\s*=\s*True"),
             "trust_remote_code=True": re.compile(r"trust_remote_code\s*=\s*True")}
ALLOWED = {("tools/launch.py", "pickle")}


def test_the_package_never_unpickles_or_evaluates_what_it_reads():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE))
        text = path.read_text()
        for what, pattern in FORBIDDEN.items():
            if (rel, what) not in ALLOWED and pattern.search(text):
                found.append(f"{rel}: {what}: {pattern.search(text).group(0)!r}")
    assert found == []
    launcher = (PACKAGE / "tools" / "launch.py").read_text()       # the exception is still needed
    assert FORBIDDEN["pickle"].search(launcher)
    assert "torch.load(" in (PACKAGE / "checkpoint" / "rank_file.py").read_text()


def _config(**extra):
    return {**LLAMA31_8B, **extra}


def test_a_model_folder_asking_for_custom_code_is_refused(tmp_path):
    raw = _config(model_type="my_llama", architectures=["MyLlamaForCausalLM"],
                  auto_map={"AutoModelForCausalLM": "modeling_my.MyLlamaForCausalLM"})
    with pytest.raises(ValueError) as err:
        model_fields_from_hf(raw, tmp_path / "config.json")
    line = str(err.value)
    assert "auto_map: modeling_my.MyLlamaForCausalLM" in line and "never runs code" in line
    assert "\n" not in line
    raw = _config(architectures=["MyLlamaForCausalLM"], auto_map={"AutoConfig": "c.MyConfig"})
    with pytest.raises(ValueError, match="never runs code from a model folder"):
        model_fields_from_hf(raw, tmp_path / "config.json")     # llama's model_type, not its class


def test_custom_code_of_a_family_we_implement_is_ignored_with_one_warning(tmp_path, caplog):
    raw = _config(auto_map={"AutoModelForCausalLM": "modeling_llama_fast.LlamaForCausalLM"})
    where = tmp_path / "config.json"
    with caplog.at_level(logging.WARNING, logger="tsp_trainer.config.hf_model"):
        fields = model_fields_from_hf(raw, where)
        model_fields_from_hf(raw, where)
    assert fields == model_fields_from_hf(_config(), where)
    lines = [r.getMessage() for r in caplog.records if "auto_map" in r.getMessage()]
    assert len(lines) == 1 and "it is ignored" in lines[0] and HF_FAMILIES["llama"].architecture in lines[0]
