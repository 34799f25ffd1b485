"""The measurement scripts behind docs/benchmarks.md's communication section run end to end at
tiny sizes (so they cannot rot): experiments/gloo_collectives.py times gloo's op and Comm's direct
exchange side by side; experiments/cpu_split.py splits a step's CPU time into compute (fake process
group) and the rest (gloo ranks); the attention-route, document-masking and offload cost scripts
report each timing ratio as the median [min-max] of its interleaved repeats."""

import json

import pytest

from tests.helpers.experiments import load_experiment

pytestmark = pytest.mark.distributed


def test_gloo_collectives_times_both_kinds(tmp_path):
    out = tmp_path / "g.json"
    script = load_experiment("gloo_collectives")
    assert script.main(["--degrees", "2", "--repeats", "2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]["D=2"]
    kinds = {name.rsplit("[", 1)[1].rstrip("]") for name in rows}
    assert kinds == {"gloo", "direct"}
    assert sum(name.startswith(("all_gather", "reduce_scatter")) for name in rows) == 4
    assert all(r["wall_ms"] > 0 and r["cpu_ms_summed_over_ranks"] > 0 for r in rows.values())


def test_cpu_split_reports_compute_and_communication(tmp_path):
    out = tmp_path / "c.json"
    script = load_experiment("cpu_split")
    assert script.main(["--degree", "2", "--seq-len", "64", "--steps", "1",
                        "--schemes", "tsp:selective,tp", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["scheme"], r["tsp_recompute"]) for r in rows] == [("tsp", "selective"), ("tp", None)]
    for r in rows:
        assert len(r["cpu_s_per_rank"]) == 2 and r["wall_s"] > 0 and r["compute_only_cpu_s_rank0"] > 0
    assert rows[-1]["wall_over_ref"] == {"median": 1.0, "min": 1.0, "max": 1.0, "repeats": 1}
    assert rows[0]["cpu_summed_over_ref"]["repeats"] == 1


def _assert_spread(spread: dict, repeats: int) -> None:
    assert spread["repeats"] == repeats and 0 < spread["min"] <= spread["median"] <= spread["max"]


def test_attention_route_ab_reports_each_ratio_with_its_range(tmp_path):
    script = load_experiment("attention_route_ab")
    out = script.main(["--seq-len", "128", "--degree", "2", "--steps", "3"])
    times = out["step_times_s"]
    assert sorted(times) == ["tp", "tsp_lse", "tsp_mask"] and all(len(t) == 3 for t in times.values())
    for key in ("tsp_lse / tp", "tsp_mask / tp", "tsp_lse / tsp_mask"):
        _assert_spread(out[key], 3)
    per_round = sorted(a / b for a, b in zip(times["tsp_lse"], times["tp"]))
    assert out["tsp_lse / tp"]["median"] == per_round[1]


def test_document_masking_cost_reports_time_ratios_with_their_range(tmp_path):
    script = load_experiment("document_masking_cost")
    out = script.main(["--seq-len", "256", "--degree", "2", "--documents", "4", "--steps", "3"])
    assert sorted(out["variants"]) == ["docs1", "docs4", "off"]
    _assert_spread(out["ratios"]["time docs4 / docs1"], 3)
    _assert_spread(out["ratios"]["time docs1 / off"], 3)


def test_offload_cost_reports_the_ratio_with_its_range(tmp_path):
    out = tmp_path / "o.json"
    script = load_experiment("offload_cost")
    assert script.main(["--degree", "2", "--seq-len", "128", "--steps", "3", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    _assert_spread(doc["offload_over_plain"], 3)
    assert doc["plain"]["first_loss"] == doc["offload"]["first_loss"]


def test_step_time_table_runs_each_cell_and_tables_median_and_range(tmp_path):
    """experiments/step_time_table.py: one tsp-bench launch per (degree, length, mode) and round,
    each launch the median [min-max] of its interleaved TSP/TP step ratios, a cell the median
    [min-max] of its launches, tabled one row per run. One real launch; the combination of
    launches on that launch's cell twice and on made-up cells."""
    out = tmp_path / "t.json"
    script = load_experiment("step_time_table")
    assert script.main(["--degrees", "2", "--seq-lens", "64", "--modes", "full", "--launches", "1",
                        "--steps", "3", "--json", str(out)]) == 0
    (launch,) = json.loads(out.read_text())["cells"]
    assert (launch["degree"], launch["seq_len"], launch["mode"]) == (2, 64, "full")
    cell = script.combine([launch, launch])
    assert cell["launches"] == 2 and cell["ratio"]["repeats"] == 2
    for c in [cell, *cell["per_launch"]]:
        r = c["ratio"]
        assert r["min"] <= r["median"] <= r["max"] and c["tsp_s"] > 0 < c["tp_s"]
    assert [c["ratio"]["repeats"] for c in cell["per_launch"]] == [3, 3]
    fake = [{"degree": 4, "seq_len": 8192, "mode": "none", "steps": 3, "tsp_s": 2.5, "tp_s": 2.0,
             "ratio": {"median": 1.25, "min": 1.2, "max": 1.31, "repeats": 3}}]
    assert script.table(fake, ["none"]).splitlines() == [
        "| run | TSP none / TP |", "|---|---|", "| D = 4, 8K | 1.25x [1.20-1.31] (2.50 / 2.00 s) |"]
    launches = [dict(fake[0], tsp_s=t, ratio=dict(fake[0]["ratio"], median=m))
                for t, m in [(2.5, 1.25), (2.2, 1.05), (2.4, 1.10)]]
    cell = script.combine(launches)
    assert cell["ratio"] == {"median": 1.10, "min": 1.05, "max": 1.25, "repeats": 3}
    assert (cell["tsp_s"], cell["launches"], cell["per_launch"]) == (2.4, 3, launches)
