"""W&B across a crash and a relaunch (offline mode, 2 ranks): the relaunch continues the same run id
(stored in run.json and in the checkpoint), and the steps W&B receives stay monotone: the steps
replayed between the checkpoint and the crash are skipped (wandb_replay=skip) or logged again after
the run is rewound to the checkpoint's step (wandb_replay=rewind). W&B 0.31 has no reader for its
.wandb files, so the test wraps the run object's log (rank 0) and records every step sent."""

import json

import pytest

from tests.distributed.lifecycle_cases import wandb_observed_rank
from tests.helpers.dist import run_on_ranks

pytestmark = pytest.mark.distributed
COMMON = ["parallel.tsp_degree=2", "train.steps=8", "checkpoint.every=2", "checkpoint.keep_last=10",
          "logging.wandb_mode=offline", "logging.wandb_group=sweep1", "logging.wandb_tags=[tsp,ci]",
          "train.resume=auto"]


def _launches(tmp_path, replay):
    overrides = COMMON + [f"train.output_dir={tmp_path / 'run'}", f"logging.wandb_replay={replay}"]
    first = run_on_ranks(wandb_observed_rank, 2, overrides, 6)[0]          # crashes at step 6
    second = run_on_ranks(wandb_observed_rank, 2, overrides)[0]            # resumes step 4
    return first, second


def test_relaunch_continues_one_run_and_skips_replayed_steps(tmp_path):
    first, second = _launches(tmp_path, "skip")
    assert first["run_id"] == second["run_id"]
    assert first["received"] == [1, 2, 3, 4, 5]
    assert second["received"] == [6, 7, 8]                     # step 5 replayed, not sent again
    sent = first["received"] + second["received"]
    assert sent == sorted(set(sent))                           # monotone across the two launches
    init1, init2 = first["inits"][0], second["inits"][0]
    assert init1["id"] == first["run_id"] and init1["resume"] is None
    assert init2["id"] == first["run_id"] and init2["resume"] == "allow"
    assert init1["name"] == "run" and init1["group"] == "sweep1" and init1["tags"] == ["tsp", "ci"]
    out = tmp_path / "run"
    assert json.loads((out / "run.json").read_text())["wandb_run_id"] == first["run_id"]
    meta = json.loads((out / "checkpoints" / "step_00000004" / "meta.json").read_text())
    assert meta["run"]["wandb_run_id"] == first["run_id"]
    runs = sorted(p.name for p in (out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.endswith(first["run_id"]) for r in runs)
    lines = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert lines == list(range(1, 9))                          # metrics.jsonl: each step once


@pytest.mark.slow
def test_rewind_mode_truncates_to_the_checkpoint_and_logs_the_replay(tmp_path):
    first, second = _launches(tmp_path, "rewind")
    assert first["run_id"] == second["run_id"]
    assert second["inits"][0]["resume_from"] == f"{first['run_id']}?_step=4"
    assert second["received"] == [5, 6, 7, 8]                  # after the rewind to step 4
    assert second["received"][0] > 4                           # monotone from the rewind point

