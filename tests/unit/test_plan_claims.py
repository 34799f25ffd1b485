"""tsp-plan never overstates: an ablation row the dry run does not confirm is printed as the
planner's prediction, not as a result, and --plot refuses (exit 2, one line) the modes it does
not draw instead of writing nothing and exiting 0."""

import json

import pytest

from tsp_trainer.plan import cli
from tsp_trainer.plan.ablation import STEPS, UNCONFIRMED


def test_unconfirmed_ablation_rows_are_marked_not_results(tmp_path, capsys):
    out = tmp_path / "ablation.json"
    assert cli.main(["--model", "llama3_8b", "--gpu", "h100", "--nodes", "1", "--ablation",
                     "--json", str(out)]) == 0
    table = capsys.readouterr().out
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines() if line.startswith("| +")}
    assert [s.name for s in STEPS if not s.confirmed] == ["+ lean replay", "+ chunked attention"]
    lean = rows[f"+ lean replay ({UNCONFIRMED})"]
    assert "| not a result (7,016,448 predicted) |" in lean
    assert "| not a result (7,416,832 predicted) |" in rows[f"+ chunked attention ({UNCONFIRMED})"]
    for step in [s for s in STEPS[1:] if s.confirmed]:      # every other row is printed as a result
        assert step.name in rows and "not a result" not in rows[step.name]
    assert f"{UNCONFIRMED}: the dry run of the real code" in table
    saved = {r["technique"]: r["confirmed_by_dry_run"] for r in json.loads(out.read_text())["rows"]}
    assert saved == {s.name: s.confirmed for s in STEPS}


@pytest.mark.parametrize("mode", [["--ablation"], ["--max-seq-len"], ["--dry-run", "--seq-len", "1024"]])
def test_plot_with_a_mode_it_does_not_draw_exits_2_saying_so(mode, tmp_path, capsys):
    png = tmp_path / "plot.png"
    with pytest.raises(SystemExit) as exc:
        cli.main(["--model", "llama3_8b", "--gpu", "h100", "--nodes", "1", *mode, "--plot", str(png)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"tsp-plan: error: --plot draws the ranking of layouts (no mode flag); it cannot draw "
                   f"{mode[0]}'s result: drop --plot, or use --json for a file")
    assert not png.exists()


def test_plot_draws_the_ranking(tmp_path):
    png = tmp_path / "plot.png"
    assert cli.main(["--model", "llama3_8b", "--gpu", "h100", "--nodes", "1", "--seq-len", "32768",
                     "--global-batch", "8", "--plot", str(png)]) == 0
    assert png.stat().st_size > 1000
