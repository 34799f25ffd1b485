"""A damaged latest checkpoint, through the real trainer (2 CPU processes, TSP=2): one 6-step run
with checkpoints at steps 2, 4 and 6, copied per case; its step-6 checkpoint is damaged the way
disks and people damage files, and train.resume=auto falls back to step 4, sets the damaged folder
aside and continues with the uninterrupted run's losses. An explicit path to the damaged folder is
refused (ValueError naming the file; tsp-train exits 2)."""

import os
import shutil
import subprocess
import sys

import pytest

from tests.distributed.trainer_cases import REPO, captured_log, config, train_rank
from tests.helpers.dist import run_on_ranks
from tsp_trainer.run import check_inputs

pytestmark = pytest.mark.distributed
RUN = ["train.steps=6", "checkpoint.every=2", "checkpoint.keep_last=10"]
SHARD = "model/model-tsp001-of-002.safetensors"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(losses of the uninterrupted 6 steps, its run folder)."""
    out = tmp_path_factory.mktemp("trained")
    losses = run_on_ranks(train_rank, 2, RUN + [f"train.output_dir={out}"], False)[0]["losses"]
    return losses, out


def _flip_byte(step):
    data = bytearray((step / SHARD).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (step / SHARD).write_bytes(bytes(data))
    return SHARD, "fails its sha256 check"


def _truncate(step):
    data = (step / SHARD).read_bytes()
    (step / SHARD).write_bytes(data[:len(data) - 100])
    return SHARD, "is truncated"


def _delete_shard(step):
    (step / SHARD).unlink()
    return SHARD, "is missing"


def _delete_rank_state(step):
    (step / "ranks" / "rank_00001.pt").unlink()
    return "ranks/rank_00001.pt", "is missing"


def _delete_manifest(step):
    (step / "manifest.json").unlink()
    return "manifest.json", "no manifest.json"


DAMAGE = {"flip_byte": _flip_byte, "truncate": _truncate, "delete_shard": _delete_shard,
          "delete_rank_state": _delete_rank_state, "delete_manifest": _delete_manifest}


def _damaged_copy(trained, tmp_path, kind):
    """A copy of the trained run folder whose step-6 checkpoint is damaged; (folder, file, why)."""
    run = tmp_path / "run"
    shutil.copytree(trained[1], run)
    rel, why = DAMAGE[kind](run / "checkpoints" / "step_00000006")
    return run, rel, why


def _logged_train_rank(rank, world, overrides):
    with captured_log() as log:
        out = train_rank(rank, world, overrides, False)
    return {**out, "log": log}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_auto_resume_falls_back_to_the_newest_verified_checkpoint(trained, tmp_path, kind):
    run, rel, why = _damaged_copy(trained, tmp_path, kind)
    ckpts = run / "checkpoints"
    resumed = run_on_ranks(_logged_train_rank, 2, RUN + [f"train.output_dir={run}", "train.resume=auto"])
    assert resumed[0]["losses"] == trained[0][4:]                  # continued from step 4, exactly
    assert (ckpts / "damaged" / "step_00000006").is_dir()          # set aside, never deleted
    skipped = [x for x in resumed[0]["log"] if "skipping" in x]
    assert len(skipped) == 1 and "step_00000006" in skipped[0] and why in skipped[0]
    if kind != "delete_manifest":
        assert rel in skipped[0]
    assert "[rank 0] train.resume=auto: falling back to step_00000004, the newest checkpoint that " \
        "verifies" in resumed[0]["log"]
    assert [x for x in resumed[1]["log"] if "skipping" in x or "verified" in x] == []   # rank 0's job
    assert "resumed from" in " ".join(resumed[0]["log"]) and f"{ckpts}/step_00000004" in " ".join(
        resumed[0]["log"])
    # The resumed run saved step 6 afresh; `latest` names it, the damaged copy is untouched.
    assert (ckpts / "latest").read_text().strip() == "step_00000006"
    assert (ckpts / "step_00000006" / "manifest.json").is_file()
    assert sorted(p.name for p in (ckpts / "damaged").iterdir()) == ["step_00000006"]


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_explicit_resume_of_a_damaged_checkpoint_is_refused(trained, tmp_path, kind):
    run, rel, why = _damaged_copy(trained, tmp_path, kind)
    step = run / "checkpoints" / "step_00000006"
    cfg = config(RUN + [f"train.output_dir={tmp_path / 'new'}", f"train.resume={step}"])
    with pytest.raises(ValueError, match=why) as err:
        check_inputs(cfg, world_size=2, rank=0)
    assert rel in str(err.value) and str(step) in str(err.value)
    assert step.is_dir()                                           # an explicit path is not moved


def test_tsp_train_exits_2_naming_the_damaged_file(trained, tmp_path):
    run, rel, _ = _damaged_copy(trained, tmp_path, "flip_byte")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-m", "tsp_trainer", "train", "recipes/tiny_cpu.yaml",
                           "parallel.tsp_degree=1", f"train.output_dir={tmp_path / 'new'}",
                           f"train.resume={run / 'checkpoints' / 'step_00000006'}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    errors = [x for x in done.stderr.splitlines() if x.startswith("tsp-train: error:")]
    assert done.returncode == 2 and len(errors) == 1, done.stderr[-2000:]
    assert rel in errors[0] and "fails its sha256 check" in errors[0]
