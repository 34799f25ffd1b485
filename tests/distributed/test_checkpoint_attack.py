"""A handed-over checkpoint whose rank state runs code when unpickled (the manifest's sha256 and
size updated to match: whoever hands over a checkpoint writes its manifest too). A 2-rank run
checkpointed at steps 2 and 4; its step-4 ranks/rank_00000.pt is replaced by a pickle whose loading
opens (creates) a file. Rank 0 of the 2-rank relaunch with train.resume=auto exits 2 before any
process group (its peer is never started), one line naming the file and the type found; the file
is not created; the checkpoint is set aside, so the next launch resumes step 2."""

import json
import os
import pickle
import shutil
import socket
import subprocess
import sys

import pytest

from tests.distributed.trainer_cases import FAST, RECIPE, REPO, config, train_rank
from tests.helpers.dist import run_on_ranks
from tsp_trainer.checkpoint.disk_format import file_entry, verify_manifest
from tsp_trainer.run import check_inputs

pytestmark = pytest.mark.distributed
RUN = ["train.steps=4", "checkpoint.every=2", "checkpoint.keep_last=10"]
RANK_STATE = "ranks/rank_00000.pt"


class _OpensAFile:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    run_on_ranks(train_rank, 2, RUN + [f"train.output_dir={out}"], False)
    return out


def _attacked_copy(trained, tmp_path, sentinel):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    step = run / "checkpoints" / "step_00000004"
    (step / RANK_STATE).write_bytes(pickle.dumps({"loader": _OpensAFile(sentinel)}))
    entries = json.loads((step / "manifest.json").read_text())
    entries["files"][RANK_STATE] = file_entry(step / RANK_STATE)
    (step / "manifest.json").write_text(json.dumps(entries))
    assert verify_manifest(step) is None
    return run, step


def _rank0_of_two(overrides):
    """tsp-train as global rank 0 of a 2-process job whose rank 1 never starts: a process group
    would wait for it (and time out), so exiting at all proves none was built."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    return subprocess.run([sys.executable, "-m", "tsp_trainer", "train", RECIPE, *FAST, *overrides],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=200)


def test_a_rank_state_that_runs_code_exits_2_naming_it_and_nothing_runs(trained, tmp_path):
    sentinel = tmp_path / "opened_by_the_pickle"
    run, step = _attacked_copy(trained, tmp_path, sentinel)
    done = _rank0_of_two(RUN + [f"train.output_dir={run}", "train.resume=auto"])
    errors = [x for x in done.stderr.splitlines() if x.startswith("tsp-train: error:")]
    assert done.returncode == 2 and len(errors) == 1, done.stderr[-3000:]
    assert str(step / RANK_STATE) in errors[0] and f"needs {open.__module__}.open," in errors[0]
    assert not sentinel.exists()
    assert (run / "checkpoints" / "damaged" / "step_00000004").is_dir() and not step.exists()
    # The next launch falls back to the previous verified checkpoint, as for a damaged one.
    cfg = config(RUN + [f"train.output_dir={run}", "train.resume=auto"])
    assert check_inputs(cfg, world_size=2, rank=0).resume_path == run / "checkpoints" / "step_00000002"
    assert not sentinel.exists()
