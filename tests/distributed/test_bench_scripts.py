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
