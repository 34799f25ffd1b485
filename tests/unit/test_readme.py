"""The README stays a five-minute read: at most 120 lines, short table cells (a command and at
most a short note: rendered, two lines at most), and its quick start keeps the two commands a
fresh machine runs (the main job and the test command that .ci/run runs)."""

from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
MAX_LINES = 120
MAX_CELL = 100          # characters of Markdown source: two rendered lines of a README table cell


def table_cells(text: str) -> list[str]:
    return [cell.strip() for line in text.splitlines() if line.startswith("|")
            for cell in line.strip().strip("|").split(" | ")]


def test_readme_is_short():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= MAX_LINES


def test_readme_table_cells_are_short():
    long = [cell for cell in table_cells(README.read_text(encoding="utf-8")) if len(cell) > MAX_CELL]
    assert long == []


def test_readme_quick_start_installs_then_runs():
    text = README.read_text(encoding="utf-8")
    install = 'python3 -m venv .venv && .venv/bin/pip install -e ".[dev]" && '
    assert install + ".venv/bin/tsp-launch " in text
    assert install + ".venv/bin/python -m pytest\n" in text


def test_the_cell_rule_can_fail():
    assert table_cells("| a | b |\n|---|---|\n| `x` | " + "y" * 120 + " |")[-1] == "y" * 120
