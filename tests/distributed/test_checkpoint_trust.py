"""Checkpoints from elsewhere, through the real trainer (2 CPU processes, TSP=2; one 4-step run
checkpointed at steps 2 and 4, copied per case).

A handed-over checkpoint whose rank state runs code when unpickled (the manifest's sha256 and
size updated to match: whoever hands over a checkpoint writes its manifest too). A 2-rank run
checkpointed at steps 2 and 4; its step-4 ranks/rank_00000.pt is replaced by a pickle whose loading
opens (creates) a file. Rank 0 of the 2-rank relaunch with train.resume=auto exits 2 before any
process group (its peer is never started), one line naming the file and the type found; the file
is not created; the checkpoint is set aside, so the next launch resumes step 2.

A checkpoint of the older rank-state format (the NumPy RNG state as a numpy array) is refused with
the conversion command; converted by `tsp-train convert-checkpoint`, it resumes with the
uninterrupted run's losses."""

import json
import os
import pickle
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.distributed.trainer_cases import FAST, RECIPE, REPO, config, train_rank
from tests.helpers.dist import run_on_ranks
from tsp_trainer.checkpoint.disk_format import file_entry, verify_manifest
from tsp_trainer.checkpoint.rank_file import read_rank_state
from tsp_trainer.checkpoint.train_state import tensors_as_ints
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
    """(losses of the uninterrupted 4 steps, its run folder)."""
    out = tmp_path_factory.mktemp("trained")
    losses = run_on_ranks(train_rank, 2, RUN + [f"train.output_dir={out}"], False)[0]["losses"]
    return losses, out


def _attacked_copy(trained, tmp_path, sentinel):
    run = tmp_path / "run"
    shutil.copytree(trained[1], run)
    step = run / "checkpoints" / "step_00000004"
    (step / RANK_STATE).write_bytes(pickle.dumps({"loader": _OpensAFile(sentinel)}))
    _update_manifest(step, [RANK_STATE])
    return run, step


def _update_manifest(step, rels):
    """What whoever hands over a checkpoint does: a manifest matching the files."""
    entries = json.loads((step / "manifest.json").read_text())
    for rel in rels:
        entries["files"][rel] = file_entry(step / rel)
    (step / "manifest.json").write_text(json.dumps(entries))
    assert verify_manifest(step) is None


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


def _as_older_format(path):
    """Rewrite a rank state as the earlier writer saved it: np.random.get_state()'s tuple (a numpy
    array), random.getstate()'s tuple, the loader's lists as lists."""
    new = read_rank_state(path)
    rng = new["rng"]
    numpy_rng, python = rng["numpy"], rng["python"]
    torch.save({"loader": tensors_as_ints(new["loader"]), "scheduler": tensors_as_ints(new["scheduler"]),
                "rng": {"torch": rng["torch"], "cuda": rng["cuda"],
                        "python": (python["version"], tuple(python["state"].tolist()), python["gauss"]),
                        "numpy": (numpy_rng["bit_generator"], numpy_rng["key"].numpy().astype(np.uint32),
                                  numpy_rng["pos"], numpy_rng["has_gauss"], numpy_rng["gauss"])}}, path)


def test_an_older_checkpoint_is_refused_then_converted_and_resumes_exactly(trained, tmp_path):
    losses, out = trained
    step = tmp_path / "older" / "step_00000002"
    shutil.copytree(out / "checkpoints" / "step_00000002", step)
    ranks = sorted(str(p.relative_to(step)) for p in step.glob("ranks/rank_*.pt"))
    for rel in ranks:
        _as_older_format(step / rel)
    _update_manifest(step, ranks)
    resume = RUN + [f"train.output_dir={tmp_path / 'continued'}", f"train.resume={step}"]
    with pytest.raises(ValueError, match=f"run `tsp-train convert-checkpoint {step}` once"):
        check_inputs(config(resume), world_size=2, rank=0)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-m", "tsp_trainer", "train", "convert-checkpoint", str(step)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "2 rank state file(s) converted" in done.stdout, done.stderr[-2000:]
    resumed = run_on_ranks(train_rank, 2, resume, False)[0]["losses"]
    assert resumed == losses[2:]
