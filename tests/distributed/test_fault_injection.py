"""Fault injection on 4 CPU processes (DP=2 x TSP=2): a rank SIGKILLed in the middle of a step
(inside the MLP ring) or of a checkpoint save, and a NaN loss on one rank only."""

import os
import shutil

import pytest

from tests.distributed.fault_cases import assert_nan_step_is_skipped, faulty_train_rank, weights_equal
from tests.distributed.trainer_cases import train_rank
from tests.helpers.dist import run_on_ranks

pytestmark = pytest.mark.distributed
STEADY = ["train.steps=8", "checkpoint.every=2", "checkpoint.keep_last=10"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    return run_on_ranks(train_rank, 4, STEADY + [f"train.output_dir={out}"])[0]


@pytest.mark.parametrize("kind,at_step,resumes_from", [("ring", 6, 4), ("save", 6, 4)])
def test_sigkill_then_auto_resume_matches(tmp_path, uninterrupted, kind, at_step, resumes_from):
    overrides = STEADY + [f"train.output_dir={tmp_path}", "train.resume=auto"]
    with pytest.raises(RuntimeError, match="distributed run failed"):
        run_on_ranks(faulty_train_rank, 4, overrides, (kind, at_step, 1), pg_timeout_s=20)
    ckpts = tmp_path / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == f"step_{resumes_from:08d}"
    assert not (ckpts / f"step_{at_step:08d}").exists()        # a partial save is never published

    resumed = run_on_ranks(train_rank, 4, overrides)[0]         # the relaunch
    assert resumed["losses"] == uninterrupted["losses"][resumes_from:]
    assert weights_equal(resumed["weights"], uninterrupted["weights"])
    assert not list(ckpts.glob(".step_*.tmp"))                 # stale temporaries cleaned up


def test_kill_during_background_write_never_publishes(tmp_path, uninterrupted):
    """checkpoint.async_save=true: a rank killed while its writer thread writes the step-6
    checkpoint (training has moved on) never gets it published; the relaunch resumes from step 4
    and equals the uninterrupted run bit for bit."""
    overrides = STEADY + [f"train.output_dir={tmp_path}", "train.resume=auto", "checkpoint.async_save=true"]
    with pytest.raises(RuntimeError, match="distributed run failed"):
        run_on_ranks(faulty_train_rank, 4, overrides, ("async_write", 6, 1), pg_timeout_s=20)
    ckpts = tmp_path / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000004"
    assert not (ckpts / "step_00000006").exists()
    resumed = run_on_ranks(train_rank, 4, overrides)[0]
    assert resumed["losses"] == uninterrupted["losses"][4:]
    assert weights_equal(resumed["weights"], uninterrupted["weights"])
    assert not list(ckpts.glob(".step_*.tmp"))


CONSTANT_LR = ["optim.warmup_steps=0", "optim.min_lr=3e-3", "checkpoint.every=2",
               "checkpoint.keep_last=10"]


def test_nan_on_one_rank_is_skipped_everywhere(tmp_path):
    """Step 3's loss is NaN on rank 1 only. Every rank skips that update (counted), so with a
    constant learning rate the weights after 3 steps equal those after 2 clean steps."""
    assert_nan_step_is_skipped(4, CONSTANT_LR, tmp_path)


def test_nan_with_stop_policy_stops_before_update_and_never_checkpoints(tmp_path):
    out = run_on_ranks(faulty_train_rank, 4, CONSTANT_LR + ["train.steps=4", "train.nonfinite=stop",
                                                            f"train.output_dir={tmp_path}"], ("nan", 3, 1))
    for o in out:
        assert "non-finite" in o["stopped"] and "step 3" in o["stopped"]
    ckpts = tmp_path / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000002"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000002"]


def _disk_full_rank(rank, world, overrides):
    import os

    import tsp_trainer.checkpoint.store as store
    from tsp_trainer.trainer import CheckpointSaveError, Trainer

    from tests.distributed.trainer_cases import config
    trainer = Trainer(config(overrides), world_size=world, global_rank=rank)
    real = store.atomic_torch_save

    def full_at_step_4_on_rank_1(obj, path):
        # a real ENOSPC: the file rank 1 writes is a link to /dev/full, which fails every write
        if trainer.state.step == 4 and rank == 1:
            os.symlink("/dev/full", path.with_name(path.name + ".tmp"))
        real(obj, path)
    store.atomic_torch_save = full_at_step_4_on_rank_1
    try:
        trainer.fit()
    except CheckpointSaveError as err:
        return str(err), err.seen_here
    return "no error", False


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_disk_full_during_save_keeps_latest(tmp_path):
    out = run_on_ranks(_disk_full_rank, 2, ["parallel.tsp_degree=1", "train.steps=6",
                                            "checkpoint.every=2", f"train.output_dir={tmp_path}"])
    full = tmp_path / "checkpoints" / ".step_00000004.tmp" / "ranks" / "rank_00001.pt.tmp"
    for rank, (message, seen_here) in enumerate(out):
        assert (f"step-4 checkpoint failed on rank 1: [Errno 28] No space left on device: "
                f"'{full}'") in message, message
        assert "unexpected pos" not in message and "iostream" not in message
        assert "step_00000002" in message                   # names what is still the latest
        assert seen_here == (rank == 1)                     # the CLI prints it from rank 1 only
    ckpts = tmp_path / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000002"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000002"]   # nothing half-written


def _shape_rank(rank, world, overrides):
    from tsp_trainer.trainer import Trainer

    from tests.distributed.trainer_cases import config
    try:
        Trainer(config(overrides), world_size=world, global_rank=rank)
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.fixture(scope="module")
def one_rank_run(tmp_path_factory):
    """One process, D=1, 2 steps: its run folder (each test below resumes from a copy)."""
    out = tmp_path_factory.mktemp("one_rank")
    run_on_ranks(train_rank, 1, ["parallel.tsp_degree=1", f"train.output_dir={out}", "train.steps=2"],
                 False)
    return out


def test_resume_of_another_model_shape_is_refused(tmp_path, one_rank_run):
    shutil.copytree(one_rank_run, tmp_path, dirs_exist_ok=True)
    common = ["parallel.tsp_degree=1", f"train.output_dir={tmp_path}", "train.steps=2"]
    message = run_on_ranks(_shape_rank, 1, common + ["model.hidden_size=32", "train.resume=auto"])[0]
    assert "another model shape" in message and "model.hidden_size=32" in message and "64" in message


def test_corrupted_checkpoint_is_refused_on_resume(tmp_path, one_rank_run):
    """The manifest is verified before anything is loaded: a flipped byte or a missing file in the
    checkpoint train.resume names gives an error naming the file (train.resume=auto falls back
    instead: test_checkpoint_fallback.py)."""
    shutil.copytree(one_rank_run, tmp_path, dirs_exist_ok=True)
    common = ["parallel.tsp_degree=1", f"train.output_dir={tmp_path}", "train.steps=2"]
    step = tmp_path / "checkpoints" / "step_00000002"
    shard = next((step / "model").glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    message = run_on_ranks(_shape_rank, 1, common + [f"train.resume={step}", "train.steps=4"])[0]
    assert "sha256" in message and shard.name in message
    (step / "meta.json").unlink()
    message = run_on_ranks(_shape_rank, 1, common + [f"train.resume={step}", "train.steps=4"])[0]
    assert "missing meta.json" in message
