"""The metric vocabulary (observability/metric_names.py) and what reads it: the step recorder, the
console line, W&B's metric definitions, the dashboard (built and serialised offline) and the
offline report."""

import json
import math
from pathlib import Path

import pytest
import torch

from tsp_trainer.observability import StepRecorder, format_console_line
from tsp_trainer.observability.metric_names import (METRICS, PANEL_GROUPS, PANELS, comm_metric_name,
                                                    expand, metric_def)
from tsp_trainer.parallel.comm import Comm
from tsp_trainer.parallel.ledger import CommLedger



def _world_of_one() -> Comm:
    return Comm(group=None, ranks=[0], rank=0, ledger=CommLedger(), axis="world")


def _recorded_step(*, peak_flops=None, rank_stats_every=1, step=3):
    world = _world_of_one()
    rec = StepRecorder(world=world, flops=(1e9, 1.5e9), peak_flops=peak_flops,
                       rank_stats_every=rank_stats_every, device=torch.device("cpu"))
    rec.begin_step()
    with rec.waiting_for_data():
        pass
    world.ledger.record("broadcast", axis="tsp", tag="attn.weights", group_size=2, nbytes=100)
    world.ledger.record("broadcast", axis="tsp", tag="attn.weights", group_size=2, nbytes=50)
    world.ledger.record("send", axis="tsp", tag="mlp.ring", group_size=2, nbytes=7)
    world.ledger.record("all_reduce", axis="dp", tag="loss", group_size=2, nbytes=8)
    return rec.end_step(step, loss=2.5, lr=1e-3, grad_norm=0.7, tokens=4096, skipped=False,
                        skipped_steps=1, tokens_seen=40960, checkpoint_stall_s=0.25)


def test_table_rules():
    names = [m.name for m in METRICS]
    assert len(names) == len(set(names))
    for m in METRICS:
        group = m.name.split("/", 1)[0]
        assert group == m.panel and group in PANEL_GROUPS, m.name
        assert m.summary in ("min", "max", "mean", "last") and m.unit and m.description, m.name
    required = {"train/loss", "train/lr", "train/grad_norm", "train/skipped_steps", "eval/loss",
                "perf/tokens_per_s", "perf/tokens_per_s_per_gpu", "perf/mfu", "perf/step_time_s",
                "perf/step_time_max_rank", "perf/data_wait_s", "mem/peak_gib", "data/epoch"}
    assert required <= set(names)
    assert metric_def("comm/tsp/all_gather_bytes").name == "comm/*/*_bytes"
    with pytest.raises(KeyError, match="metric_names.py"):
        metric_def("loss")                       # a bare name is not a metric


def test_every_metric_has_a_panel_and_every_panel_a_metric():
    drawn = {name for panel in PANELS for name in panel.metrics}
    assert drawn == {m.name for m in METRICS}
    assert {p.group for p in PANELS} == set(PANEL_GROUPS)   # a panel sits in its first metric's group
    assert expand(("comm/*/*_bytes", "train/loss"), ["comm/tsp/send_bytes", "comm/dp/all_reduce_bytes",
                                                     "train/loss", "train/lr"]) == \
        ["comm/dp/all_reduce_bytes", "comm/tsp/send_bytes", "train/loss"]


def test_recorder_emits_table_names_comm_bytes_and_mfu():
    m = _recorded_step(peak_flops=1e12)
    for name in m:
        metric_def(name)                         # every emitted name is in the table
    assert m[comm_metric_name("tsp", "broadcast")] == 150 and m["comm/tsp/send_bytes"] == 7
    assert m["comm/dp/all_reduce_bytes"] == 8
    assert m["train/loss"] == 2.5 and m["train/skipped"] == 0 and m["train/tokens_seen"] == 40960
    dt = m["perf/step_time_s"]
    assert m["perf/tokens_per_s"] == pytest.approx(4096 / dt)
    assert m["perf/tokens_per_s_per_gpu"] == pytest.approx(4096 / dt)       # world of one
    assert m["perf/mfu"] == pytest.approx(1e9 * 4096 / dt / 1e12)
    assert m["perf/hfu"] == pytest.approx(1.5 * m["perf/mfu"])
    assert m["perf/checkpoint_stall_s"] == 0.25 and m["mem/peak_gib"] > 0.01
    assert m["perf/slowest_rank"] == 0 and 0 <= m["perf/step_time_max_rank"] <= dt
    assert _recorded_step()["perf/mfu"] is None                  # no peak known: no MFU
    assert "perf/slowest_rank" not in _recorded_step(rank_stats_every=2, step=3)


def test_console_line_reads_the_table():
    line = format_console_line(12, {"train/loss": 3.45678, "train/lr": 3e-4, "train/grad_norm": 1.2345,
                                    "perf/tokens_per_s": 12345.0, "perf/mfu": 0.412,
                                    "perf/step_time_s": 0.3456, "mem/peak_gib": 12.34,
                                    "comm/tsp/send_bytes": 5, "eval/loss": 3.2})
    assert line == ("step 12 | loss 3.4568 | lr 3.00e-04 | gnorm 1.234 | eval 3.2000 | "
                    "12.35k tok/s | MFU 41.2% | 0.35 s/step | mem 12.3 GiB")
    assert format_console_line(1, {"train/loss": 2.0, "perf/mfu": None}) == "step 1 | loss 2.0000"


def test_wandb_metric_definitions_follow_the_table():
    from tsp_trainer.observability.wandb_sink import define_metrics

    class Run:
        def __init__(self):
            self.defined = {}

        def define_metric(self, name, summary=None):
            self.defined[name] = summary
    run = Run()
    define_metrics(run)
    # W&B takes a glob only as a suffix: the comm family is declared as "comm/*"
    assert run.defined == {m.name.split("*")[0] + ("*" if "*" in m.name else ""): m.summary for m in METRICS}
    assert run.defined["comm/*"] == "mean"
    assert run.defined["train/loss"] == "min" and run.defined["mem/peak_gib"] == "max"


def test_wandb_offline_run_accepts_the_definitions(tmp_path, monkeypatch):
    """A real offline wandb run: define_metric with every name and glob of the table, then a log."""
    for key, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true",
                       "WANDB_CACHE_DIR": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(key, value)
    from tsp_trainer.observability import WandbSink

    sink = WandbSink("tsp-test", run_name="defs", config={}, mode="offline", dir=tmp_path / "run")
    sink.log(1, _recorded_step(peak_flops=1e12))
    sink.close()
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))


# ---- dashboard ------------------------------------------------------------------------------

def test_dashboard_workspace_builds_and_serialises_offline():
    from tsp_trainer.observability.dashboard import build_workspace, glob_to_regex, workspace_spec

    workspace = build_workspace(entity="team", project="tsp", name="tsp view")
    assert [s.name for s in workspace.sections] == list(PANEL_GROUPS)
    spec = workspace_spec(workspace)
    text = json.dumps(spec)
    sections = spec["spec"]["section"]["panelBankConfig"]["sections"]
    assert [s["name"] for s in sections] == list(PANEL_GROUPS)
    plotted = set()
    for section in sections:
        for panel in section["panels"]:
            config = panel["config"]
            plotted |= set(config.get("metrics", []))
            if config.get("useMetricRegex"):
                plotted.add(config["metricRegex"])
    regex = glob_to_regex("comm/*/*_bytes")
    assert regex == "^comm/[^/]+/[^/]+_bytes$" and regex in plotted
    tables = {name for p in PANELS if p.table for name in p.metrics}   # summary-table panels
    assert tables == {"eval/loss_by_position", "eval/passkey"}
    assert plotted - {regex} == {m.name for m in METRICS if "*" not in m.name} - tables
    for name in tables:
        assert f'"val": "{name}"' in text
    comm = next(s for s in sections if s["name"] == "comm")["panels"][0]["config"]
    assert comm["yLogScale"] is True and comm["metricRegex"] == regex
    assert [s.get("isOpen", False) for s in sections] == [True, True, True, False, False, False]
    assert spec["entity"] == "team" and spec["project"] == "tsp" and "tsp view" in text


# ---- offline report -------------------------------------------------------------------------

def _write_run(run: Path, steps: int = 12):
    run.mkdir(parents=True, exist_ok=True)
    lines = []
    for step in range(1, steps + 1):
        record = {"step": step, "train/loss": 7 - 0.3 * step, "train/lr": 1e-3, "train/grad_norm": 1.0 / step,
                  "perf/tokens_per_s": 1000.0 + step, "perf/mfu": None, "mem/peak_gib": 1.5,
                  "comm/tsp/broadcast_bytes": 2**20, "comm/tsp/send_bytes": 2**18,
                  "perf/step_time_s": 0.5, "perf/step_time_max_rank": 0.4, "perf/slowest_rank": 1}
        if step % 4 == 0:
            record["eval/loss"] = 7.1 - 0.3 * step
        lines.append(json.dumps(record))
    lines.insert(4, json.dumps({"step": 5, "train/loss": 99.0}))      # replaced by the later step 5
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_report_reads_last_line_per_step_and_renders(tmp_path):
    from tsp_trainer.observability.report import read_metrics, render_report, series

    run = tmp_path / "run"
    _write_run(run)
    steps = read_metrics(run / "metrics.jsonl")
    assert list(steps) == list(range(1, 13))
    assert steps[5]["train/loss"] == pytest.approx(5.5)           # the later line of step 5 won
    assert series(steps, "eval/loss")[0] == [4, 8, 12]
    assert series(steps, "perf/mfu") == ([], [])                 # None is not drawn
    png = render_report(run)
    assert png == run / "report.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 20_000


def test_nan_is_never_drawn():
    from tsp_trainer.observability.report import series

    assert series({1: {"x": 1.0}, 2: {"x": math.nan}, 3: {"x": None}, 4: {"x": True}}, "x") == ([1], [1.0])
