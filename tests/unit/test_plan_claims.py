"""tsp-plan never overstates: an ablation row the dry run does not confirm is printed as the
planner's prediction, not as a result, and --plot refuses (exit 2, one line) the modes it does
not draw instead of writing nothing and exiting 0."""

import json
from dataclasses import replace

import pytest

from tsp_trainer.plan import cli
from tsp_trainer.plan.ablation import STEPS, UNCONFIRMED, format_ablation


def _rows(table: str) -> dict[str, str]:
    return {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines() if line.startswith("| +")}


def test_every_ablation_row_is_a_result_and_an_unconfirmed_one_would_be_marked(tmp_path, capsys):
    """The lean replay and chunked attention rows are confirmed by the dry run at their lengths
    (docs/long_context/longest_context.md) and printed as results; a row marked unconfirmed is
    printed as the planner's prediction."""
    out = tmp_path / "ablation.json"
    assert cli.main(["--model", "llama3_8b", "--gpu", "h100", "--nodes", "1", "--ablation",
                     "--json", str(out)]) == 0
    table = capsys.readouterr().out
    rows = _rows(table)
    assert all(s.confirmed for s in STEPS[:-1]) and not STEPS[-1].confirmed
    assert "| 8,096,768 |" in rows["+ lean replay"] and "keep=nothing" in rows["+ lean replay"]
    assert "| 9,789,440 |" in rows["+ chunked attention"]
    assert "| not a result (11,415,552 predicted) |" in rows[f"+ norm handoff ({UNCONFIRMED})"]
    for step in STEPS[1:-1]:                                 # every confirmed row as a result
        assert step.name in rows and "not a result" not in rows[step.name]
    saved = {r["technique"]: r["confirmed_by_dry_run"] for r in json.loads(out.read_text())["rows"]}
    assert saved == {s.name: s.confirmed for s in STEPS}

    from tsp_trainer.config.model import model_config
    from tsp_trainer.plan.ablation import AblationRow
    from tsp_trainer.plan.hardware import get_profile
    from tsp_trainer.plan.longest import longest_seq_len

    step = replace(STEPS[-2], confirmed=False)
    longest = longest_seq_len(model_config("llama3_8b"), "tsp", hw=get_profile("h100"), nodes=1,
                              offload=True, offload_optimizer=True, replay_keeps=step.replay_keeps,
                              segments=step.segments, fields=step.fields)
    marked = format_ablation([AblationRow(step, longest)], header="h")
    line = _rows(marked)[f"+ chunked attention ({UNCONFIRMED})"]
    assert "| not a result (9,789,440 predicted) |" in line
    assert f"{UNCONFIRMED}: the dry run of the real code" in marked


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
