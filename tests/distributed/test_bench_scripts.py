"""The measurement scripts behind docs/benchmarks.md's communication section run end to end at
tiny sizes (so they cannot rot): experiments/gloo_collectives.py times gloo's op and Comm's direct
exchange side by side; experiments/cpu_split.py splits a step's CPU time into compute (fake process
group) and the rest (gloo ranks)."""

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


def test_step_time_table_runs_each_cell_and_tables_median_and_range(tmp_path):
    """experiments/step_time_table.py: one tsp-bench launch per (degree, length, mode), each cell
    the median [min-max] of its interleaved TSP/TP step ratios, tabled one row per run."""
    out = tmp_path / "t.json"
    script = load_experiment("step_time_table")
    assert script.main(["--degrees", "2", "--seq-lens", "64", "--modes", "full,selective",
                        "--steps", "3", "--json", str(out)]) == 0
    cells = json.loads(out.read_text())["cells"]
    assert [(c["degree"], c["seq_len"], c["mode"]) for c in cells] == [(2, 64, "full"), (2, 64, "selective")]
    for c in cells:
        r = c["ratio"]
        assert r["steps"] == 3 and r["min"] <= r["median"] <= r["max"] and c["tsp_s"] > 0 < c["tp_s"]
    fake = [{"degree": 4, "seq_len": 8192, "mode": "none", "tsp_s": 2.5, "tp_s": 2.0,
             "ratio": {"median": 1.25, "min": 1.2, "max": 1.31, "steps": 3}}]
    assert script.table(fake, ["none"]).splitlines() == [
        "| run | TSP none / TP |", "|---|---|", "| D = 4, 8K | 1.25x [1.20-1.31] (2.50 / 2.00 s) |"]
