"""The Trainer's metrics as a user sees them (2 CPU processes): every name in metrics.jsonl is a
row of the table, MFU from logging.peak_tflops on CPU, the resolved config in config.yaml and in
W&B's run config, and the slowest rank named."""

import json

import pytest
import yaml

from tests.distributed.trainer_cases import config, record_wandb
from tests.helpers.dist import run_on_ranks
from tsp_trainer.config import load_config
from tsp_trainer.observability.flops import flops_per_token
from tsp_trainer.observability.metric_names import metric_def

pytestmark = pytest.mark.distributed


def _captured_wandb_rank(rank, world, overrides):
    """Run with logging.wandb_mode=offline, wandb.init replaced by a recorder: what the Trainer
    hands W&B."""
    from tsp_trainer.trainer import Trainer

    seen = record_wandb()
    history = Trainer(config(overrides), world_size=world, global_rank=rank).fit()
    return {"seen": seen, "history": history}


def test_metrics_names_mfu_and_resolved_config(tmp_path):
    out = tmp_path / "run"
    overrides = ["train.steps=3", "checkpoint.enabled=false", "logging.wandb_mode=offline",
                 "logging.peak_tflops=0.5", "logging.rank_stats_every=1", "train.dtype=auto",
                 "model.num_layers=1", f"train.output_dir={out}"]
    result = run_on_ranks(_captured_wandb_rank, 2, overrides)[0]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    for line in lines:
        for name in set(line) - {"step"}:
            metric_def(name)                       # every logged name is a row of the table
    last = lines[-1]
    cfg = config(overrides)
    fpt = flops_per_token(cfg.model.to_model_config(), cfg.data.seq_len)
    assert last["perf/mfu"] == pytest.approx(fpt * last["perf/tokens_per_s_per_gpu"] / 0.5e12)
    assert last["perf/tokens_per_s_per_gpu"] == pytest.approx(last["perf/tokens_per_s"] / 2)
    assert last["perf/slowest_rank"] in (0, 1) and last["comm/tsp/broadcast_bytes"] > 0
    # W&B got the same metrics, the table's definitions and the resolved config
    seen = result["seen"]
    assert [s for s, _ in seen["logged"]] == [1, 2, 3] and "perf/mfu" in seen["logged"][-1][1]
    assert seen["defined"]["train/loss"] == "min"
    wb = seen["config"]
    assert {k: v for k, v in wb["run"].items() if k != "auto"} == {
        "world_size": 2, "dp_degree": 1, "tsp_degree": 2, "device": "cpu", "peak_tflops": 0.5,
        "attention_kernel": "cpu", "nodes": [0, 0]}
    # the auto settings resolved against the host's memory (tests/distributed/test_auto_settings_run.py)
    assert wb["run"]["auto"]["memory_budget_source"].startswith("host MemAvailable")
    assert wb["parallel"]["tsp_recompute"] in ("full", "selective", "none")
    assert wb["model"]["hidden_size"] == 64 and wb["model"]["num_layers"] == 1   # named size resolved
    assert wb["train"]["dtype"] == "fp32" and wb["parallel"]["dp_degree"] == 1
    # config.yaml says the same and loads back to the resolved config
    written = yaml.safe_load((out / "config.yaml").read_text())
    assert written["model"]["vocab_size"] == 1024 and written["train"]["dtype"] == "fp32"
    assert load_config(out / "config.yaml").to_dict() == {k: v for k, v in wb.items() if k != "run"}


def _straggler_rank(rank, world, overrides, victim, delay):
    import time

    from tsp_trainer.trainer import Trainer

    trainer = Trainer(config(overrides), world_size=world, global_rank=rank)
    if rank == victim:
        loader = trainer.loader

        class Slow:
            def __next__(self):
                time.sleep(delay)
                return next(loader)

            def __getattr__(self, name):          # state_dict, stats, close: the real loader's
                return getattr(loader, name)
        trainer.loader = Slow()
    return trainer.fit()


@pytest.mark.parametrize("victim", [0, 1])
def test_slowest_rank_is_named(tmp_path, victim):
    """One rank of a TSP pair reads its batches 0.3 s late: the rank stats name it as the slowest
    (its own time excludes the time blocked in collectives, which its peer spends waiting)."""
    history = run_on_ranks(_straggler_rank, 2, [
        "train.steps=4", "checkpoint.enabled=false", "logging.rank_stats_every=2",
        f"train.output_dir={tmp_path}"], victim, 0.3)[0]
    stats = [h for h in history if "perf/slowest_rank" in h]
    assert [h["train/loss"] is not None for h in stats] == [True, True] and len(history) == 4
    for h in stats:
        assert h["perf/slowest_rank"] == victim
        assert h["perf/step_time_max_rank"] >= 0.3 and h["perf/data_wait_max_rank"] >= 0.3
