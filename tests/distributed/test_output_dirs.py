"""Run folders with the whole Trainer (one process): a relaunch into a used folder, rollbacks and
overwrites keep `latest` naming an existing checkpoint and metrics.jsonl holding each step once;
train.resume takes a run folder; non-finite runs stop and are never checkpointed."""

import json

import pytest
import torch

from tests.distributed.trainer_cases import config
from tests.helpers.dist import run_on_ranks

pytestmark = pytest.mark.distributed
ONE = ["parallel.tsp_degree=1", "optim.warmup_steps=0", "checkpoint.keep_last=3"]


def launch_rank(rank, world, overrides):
    from tsp_trainer.trainer import Trainer

    try:
        trainer = Trainer(config(ONE + overrides), world_size=world, global_rank=rank)
    except ValueError as err:
        return {"refused": str(err)}
    history = trainer.fit()
    return {"steps": [i + 1 + trainer.state.step - len(history) for i in range(len(history))],
            "step": trainer.state.step, "notes": trainer.session.notes,
            "run_id": trainer.session.identity.wandb_run_id}


def _state(out):
    ckpts = out / "checkpoints"
    latest = (ckpts / "latest").read_text().strip()
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    return latest, sorted(p.name for p in ckpts.glob("step_*")), steps


def test_relaunches_into_a_used_folder(tmp_path):
    out = tmp_path / "run"
    at = [f"train.output_dir={out}"]
    first = run_on_ranks(launch_rank, 1, at + ["train.steps=40", "checkpoint.every=10"])[0]
    assert _state(out) == ("step_00000040", ["step_00000020", "step_00000030", "step_00000040"],
                           list(range(1, 41)))

    # 5 more steps with the default resume=none into the same folder: accepting them would prune
    # their step_5 at once while `latest` names it, so they are refused in one line naming the
    # choices.
    refused = run_on_ranks(launch_rank, 1, at + ["train.steps=5"])[0]["refused"]
    assert "already holds checkpoints" in refused and "train.resume=auto" in refused

    # resume=auto: nothing left to do, same run.
    again = run_on_ranks(launch_rank, 1, at + ["train.steps=40", "train.resume=auto"])[0]
    assert again["steps"] == [] and again["run_id"] == first["run_id"]

    # A rollback to step 20 of this folder, to step 25: the later checkpoints are the abandoned
    # continuation; `latest` names step 25, which exists; metrics.jsonl is 1..25 once.
    back = run_on_ranks(launch_rank, 1, at + ["train.steps=25", "checkpoint.every=10",
                                              "optim.on_resume_change=checkpoint",
                                              f"train.resume={out / 'checkpoints' / 'step_00000020'}"])[0]
    assert back["steps"] == [21, 22, 23, 24, 25] and back["run_id"] == first["run_id"]
    assert any("step_00000030, step_00000040" in n for n in back["notes"]), back["notes"]
    assert _state(out) == ("step_00000025", ["step_00000020", "step_00000025"], list(range(1, 26)))

    # An explicit overwrite starts a new run in the folder: a new W&B identity, a 5-step history.
    fresh = run_on_ranks(launch_rank, 1, at + ["train.steps=5", "train.overwrite_output_dir=true"])[0]
    assert fresh["run_id"] != first["run_id"]
    assert _state(out) == ("step_00000005", ["step_00000005"], [1, 2, 3, 4, 5])

    # train.resume accepts the run folder (its latest), into another folder.
    other = run_on_ranks(launch_rank, 1, [f"train.output_dir={tmp_path / 'other'}", "train.steps=7",
                                          f"train.resume={out}", "optim.on_resume_change=recipe"])[0]
    assert other["steps"] == [6, 7] and other["run_id"] != fresh["run_id"]


def test_resume_auto_with_nothing_to_resume_says_so(tmp_path):
    out = run_on_ranks(launch_rank, 1, [f"train.output_dir={tmp_path}", "train.steps=1",
                                        "train.resume=auto"])[0]
    assert out["notes"] == (f"train.resume=auto: no checkpoint in {tmp_path}/checkpoints, "
                            "starting at step 0",)


def _nonfinite_rank(rank, world, overrides, nan_from_step):
    from tsp_trainer.trainer import NonFiniteError, Trainer

    trainer = Trainer(config(ONE + overrides), world_size=world, global_rank=rank)
    module = trainer.engine.module
    loss_sum = module.loss_sum

    def poisoned(*args, **kwargs):
        total, count = loss_sum(*args, **kwargs)
        return (total * float("nan") if trainer.state.step + 1 >= nan_from_step else total), count
    module.loss_sum = poisoned
    result = {}
    try:
        trainer.fit()
    except NonFiniteError as err:
        result["stopped"] = str(err)
    with torch.no_grad():                        # then the weights themselves go bad
        next(trainer.par.model.parameters()).view(-1)[0] = float("inf")
    try:
        trainer.save()
    except NonFiniteError as err:
        result["save_refused"] = str(err)
    return result


def test_consecutive_skips_stop_and_nonfinite_weights_are_never_checkpointed(tmp_path):
    out = run_on_ranks(_nonfinite_rank, 1, [f"train.output_dir={tmp_path}", "train.steps=20",
                                            "checkpoint.every=1", "train.max_consecutive_skips=3"], 3)[0]
    assert "3 steps in a row (steps 3-5)" in out["stopped"], out
    assert "train.max_consecutive_skips=3" in out["stopped"] and "step_00000004" in out["stopped"]
    assert "refusing to checkpoint step 5: the weights hold NaN or inf" in out["save_refused"]
    ckpts = tmp_path / "checkpoints"
    # Skipped steps leave the weights finite and are saved (3, 4); nothing after the stop.
    assert (ckpts / "latest").read_text().strip() == "step_00000004"
    assert not list(ckpts.glob(".step_*.tmp")) and not (ckpts / "step_00000005").exists()
