"""Preemption on 4 CPU processes (DP=2 x TSP=2), no periodic checkpoints: a SIGTERM that reaches
one rank during step k stops every rank after the same step (k, or k+1 if it arrived after that
step's agreement), with a checkpoint of that step; train.resume=auto then continues to the same
losses and weights as an uninterrupted run, bit for bit. train.max_runtime_min does the same when
the time left cannot fit another step and the final save."""

import json

import pytest

from tests.distributed.fault_cases import weights_equal
from tests.distributed.lifecycle_cases import preempted_rank
from tests.helpers.dist import run_on_ranks

pytestmark = pytest.mark.distributed
STEPS = 8
NO_PERIODIC = [f"train.steps={STEPS}", "checkpoint.every=0", "checkpoint.keep_last=10"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    return run_on_ranks(preempted_rank, 4, NO_PERIODIC + [f"train.output_dir={out}"])[0]


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGUSR1"])
def test_signal_on_one_rank_checkpoints_step_k_and_resume_is_exact(tmp_path, uninterrupted, signame):
    k = 3
    overrides = NO_PERIODIC + [f"train.output_dir={tmp_path}", "train.resume=auto"]
    first = run_on_ranks(preempted_rank, 4, overrides, k, 2, signame)
    stopped_at = {o["step"] for o in first}
    assert len(stopped_at) == 1 and stopped_at <= {k, k + 1}, stopped_at    # all ranks agree
    step = stopped_at.pop()
    for o in first:
        assert o["stop_reason"] == f"signal {signame}", o["stop_reason"]
        assert o["handlers_restored"] and o["marked_preempting"]
    ckpts = tmp_path / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == f"step_{step:08d}"
    assert first[0]["losses"] == uninterrupted["losses"][:step]
    seconds = first[2]["signal_to_return_s"]
    assert 0 < seconds < 60, seconds                     # one step + the save (measured ~1-3 s)
    print(f"\n{signame} at step {k}: stopped after step {step}, {step - k + 1} step(s) run after "
          f"the signal, {seconds:.2f} s from the signal to fit()'s return")

    if signame != "SIGTERM":
        return                                  # the resume is the same as after SIGTERM
    resumed = run_on_ranks(preempted_rank, 4, overrides)[0]                # the requeued job
    assert resumed["stop_reason"] is None and resumed["step"] == STEPS
    assert not resumed["marked_preempting"]
    assert resumed["losses"] == uninterrupted["losses"][step:]
    assert weights_equal(resumed["weights"], uninterrupted["weights"])
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))       # each step once


def test_max_runtime_stops_with_a_checkpoint(tmp_path):
    """train.max_runtime_min=0.001 (0.06 s): the forked ranks are older than that after start-up,
    so every rank agrees to stop after the first step, saves it and reports why."""
    out = run_on_ranks(preempted_rank, 4, NO_PERIODIC + [f"train.output_dir={tmp_path}",
                                                        "train.max_runtime_min=0.001"])
    for o in out:
        assert o["step"] == 1 and "train.max_runtime_min=0.001 reached" in o["stop_reason"], o
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000001"
