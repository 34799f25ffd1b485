"""train.resume=auto takes the newest checkpoint that verifies (checkpoint/fallback.py): on folders
built here, which candidates are tried, what is set aside and where, where `latest` points, that
pruning never sees a damaged folder, and that only rank 0 looks."""

import json

import pytest

from tsp_trainer.checkpoint.disk_format import build_manifest, verify_manifest
from tsp_trainer.checkpoint.fallback import newest_verified_checkpoint, resume_candidates
from tsp_trainer.checkpoint.store import CheckpointStore
from tsp_trainer.run.rundir import choose_resume


def _checkpoint(root, step):
    folder = root / f"step_{step:08d}"
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "shard.safetensors").write_bytes(bytes(range(256)) * (step + 1))
    (folder / "meta.json").write_text(json.dumps({"step": step}))
    (folder / "manifest.json").write_text(json.dumps(build_manifest(folder)))
    return folder


def _run(tmp_path, steps=(2, 4, 6)):
    root = tmp_path / "checkpoints"
    for step in steps:
        _checkpoint(root, step)
    (root / "latest").write_text(f"step_{steps[-1]:08d}\n")
    return root


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_verify_names_the_file_and_what_is_wrong(tmp_path):
    folder = _checkpoint(tmp_path, 3)
    shard = folder / "model" / "shard.safetensors"
    assert verify_manifest(folder) is None
    _flip(shard)
    assert verify_manifest(folder) == f"checkpoint file {shard} fails its sha256 check (corrupted)"
    shard.write_bytes(b"short")
    assert verify_manifest(folder) == (f"checkpoint file {shard} is truncated: 5 bytes, "
                                       f"manifest.json says {256 * 4}")
    shard.unlink()
    assert verify_manifest(folder) == (f"checkpoint {folder} is missing model/shard.safetensors "
                                       "(listed in manifest.json)")
    for broken in ("{not json", '{"files": {"meta.json": {"bytes": 3}}}', '{"files": []}'):
        (folder / "manifest.json").write_text(broken)
        assert verify_manifest(folder).startswith(f"checkpoint {folder} has an unreadable manifest.json")


def test_damaged_latest_is_set_aside_and_latest_repointed(tmp_path):
    root = _run(tmp_path)
    _flip(root / "step_00000006" / "model" / "shard.safetensors")
    (root / "step_00000004" / "manifest.json").unlink()
    choice = newest_verified_checkpoint(root)
    assert choice.path == root / "step_00000002"
    assert (root / "latest").read_text() == "step_00000002\n"
    assert sorted(p.name for p in (root / "damaged").iterdir()) == ["step_00000004", "step_00000006"]
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000002"]
    assert choice.warnings == (
        f"train.resume=auto: skipping {root}/step_00000006: checkpoint file "
        f"{root}/step_00000006/model/shard.safetensors fails its sha256 check (corrupted); "
        f"moved to {root}/damaged/step_00000006",
        f"train.resume=auto: skipping {root}/step_00000004: no manifest.json (a published "
        f"checkpoint always has one); moved to {root}/damaged/step_00000004",
        "train.resume=auto: falling back to step_00000002, the newest checkpoint that verifies")
    assert choice.notes[0].startswith("checkpoint step_00000002 verified: 3 files, ")


def test_a_healthy_latest_is_taken_without_warnings(tmp_path):
    root = _run(tmp_path)
    choice = newest_verified_checkpoint(root)
    assert (choice.path, choice.warnings) == (root / "step_00000006", ())
    assert not (root / "damaged").exists()


def test_candidates_start_at_latest_and_a_name_taken_in_damaged_gets_a_suffix(tmp_path):
    root = _run(tmp_path)
    (root / "latest").write_text("step_00000004\n")        # step 6: an abandoned continuation
    assert [p.name for p in resume_candidates(root)] == ["step_00000004", "step_00000002"]
    (root / "latest").unlink()
    assert [p.name for p in resume_candidates(root)] == ["step_00000006", "step_00000004",
                                                          "step_00000002"]
    (root / "damaged" / "step_00000006").mkdir(parents=True)   # set aside by an earlier launch
    (root / "step_00000006" / "meta.json").unlink()
    assert newest_verified_checkpoint(root).path == root / "step_00000004"
    assert (root / "damaged" / "step_00000006.1" / "manifest.json").exists()


def test_nothing_verifies_sets_everything_aside_and_chooses_none(tmp_path):
    root = _run(tmp_path, steps=(2,))
    (root / "step_00000002" / "model" / "shard.safetensors").unlink()
    choice = newest_verified_checkpoint(root)
    assert choice.path is None and len(choice.warnings) == 1 and "is missing" in choice.warnings[0]
    assert (root / "damaged" / "step_00000002").is_dir()


def test_only_rank_0_verifies_and_an_explicit_damaged_path_is_refused(tmp_path):
    root = _run(tmp_path)
    shard = root / "step_00000006" / "model" / "shard.safetensors"
    _flip(shard)
    assert choose_resume("auto", tmp_path, rank=1).path is None     # takes rank 0's choice later
    assert (root / "step_00000006").is_dir()                         # rank 1 moved nothing
    assert choose_resume(str(root / "step_00000006"), tmp_path, rank=1).path == root / "step_00000006"
    with pytest.raises(ValueError, match=f"train.resume='{root}/step_00000006': checkpoint file "
                                         f"{shard} fails its sha256 check"):
        choose_resume(str(root / "step_00000006"), tmp_path, rank=0)
    assert (root / "step_00000006").is_dir()                         # an explicit path is never moved
    (root / "step_00000006" / "manifest.json").unlink()
    with pytest.raises(ValueError, match="step_00000006 has no manifest.json"):
        choose_resume(str(root / "step_00000006"), tmp_path, rank=0)


class _OneRank:
    rank, size = 0, 1


def test_pruning_never_counts_or_deletes_damaged_checkpoints(tmp_path):
    root = _run(tmp_path)
    _flip(root / "step_00000006" / "model" / "shard.safetensors")
    newest_verified_checkpoint(root)
    store = CheckpointStore(root, world=_OneRank(), keep_last=1)
    store._prune(root / "step_00000004")
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000004"]
    assert (root / "damaged" / "step_00000006" / "manifest.json").exists()
