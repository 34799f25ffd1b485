"""Summaries a user can trust: tsp-train's last line compares eval losses or means of logged
losses (never two single batches) and says which; tsp-report names every layout of a run with its
steps, says "per process" on a CPU run and draws memory from 0."""

import json

from tsp_trainer.observability import report
from tsp_trainer.observability.metric_names import PANELS
from tsp_trainer.observability.summary import loss_summary
from tsp_trainer.run.rundir import LAYOUTS, record_layout

LAYOUT = {"scheme": "tsp", "tsp_degree": 2, "dp_degree": 2, "world_size": 4, "zero_stage": 1}


def test_done_line_reports_eval_losses_when_the_run_evaluated():
    history = [{"train/loss": 7.0 - i / 10} for i in range(60)]
    history[19]["eval/loss"], history[59]["eval/loss"] = 5.99461, 5.86462
    assert loss_summary(history, last_step=60) == "eval loss 5.9946 (step 20) -> 5.8646 (step 60)"
    resumed = history[40:]                                     # steps 41-60, one evaluation
    assert loss_summary(resumed, last_step=60) == "eval loss 5.8646 (step 60)"


def test_done_line_reports_means_of_logged_losses_otherwise():
    history = [{"train/loss": float(v)} for v in range(1, 61)]
    assert loss_summary(history, last_step=60) == \
        "train loss 5.5000 -> 55.5000 (means of steps 1-10 and 51-60)"
    assert loss_summary(history[:4], last_step=7) == "train loss 1.5000 -> 3.5000 (means of steps 4-5 and 6-7)"
    assert loss_summary(history[:2], last_step=2) == "train loss 1.0000 -> 2.0000 (means of steps 1 and 2)"
    assert loss_summary(history[:1], last_step=1) == "train loss 1.0000 (step 1, one batch)"


def test_layouts_file_keeps_one_line_per_launch_and_drops_abandoned_ones(tmp_path):
    record_layout(tmp_path, first_step=1, layout=LAYOUT, device="cpu")
    record_layout(tmp_path, first_step=61, layout={**LAYOUT, "tsp_degree": 1, "dp_degree": 4}, device="cpu")
    record_layout(tmp_path, first_step=41, layout=LAYOUT, device="cpu")      # a rollback to step 40
    lines = [json.loads(x) for x in (tmp_path / LAYOUTS).read_text().splitlines()]
    assert [(x["first_step"], x["dp_degree"]) for x in lines] == [(1, 2), (41, 2)]


def test_report_title_names_every_layout_with_its_steps(tmp_path):
    record_layout(tmp_path, first_step=1, layout=LAYOUT, device="cpu")
    record_layout(tmp_path, first_step=41, layout=LAYOUT, device="cpu")
    record_layout(tmp_path, first_step=61, layout={**LAYOUT, "tsp_degree": 1, "dp_degree": 4}, device="cpu")
    launches = report.read_layouts(tmp_path, last_step=80)
    steps = {s: {"train/loss": 1.0, "eval/loss": 2.0 if s in (20, 80) else None} for s in range(1, 81)}
    title = report._title(tmp_path, steps, launches)
    assert title.endswith(": steps 1-80, eval loss 2.000 (step 20) -> 2.000 (step 80) | tsp D 2 x dp 2 "
                          "ZeRO-1 (steps 1-60), tsp D 1 x dp 4 ZeRO-1 (steps 61-80) | cpu"), title
    assert report._per_device(launches) == "per process"
    assert report._per_device([{**launches[0], "device": "cuda"}]) == "per GPU"


def test_report_draws_per_process_panels_and_memory_from_zero(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    record_layout(tmp_path, first_step=1, layout=LAYOUT, device="cpu")
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "train/loss": 2.0, "mem/peak_gib": 0.52 + s / 1000,
                    "perf/tokens_per_s_per_gpu": 100.0}) + "\n" for s in range(1, 11)))
    titles = []
    original = report._draw

    def draw(ax, panel, names, steps, *, title):
        original(ax, panel, names, steps, title=title)
        titles.append(title)
        if names == ["mem/peak_gib"]:
            assert ax.get_ylim()[0] == 0
    report._draw = draw
    try:
        report.render_report(tmp_path)
    finally:
        report._draw = original
        plt.close("all")
    assert "tokens/s per process" in titles and not any("per GPU" in t for t in titles)
    assert any(p.title == "tokens/s per GPU" for p in PANELS)        # the panel's own name
