"""The offline report: the dashboard's panels (metric_names.PANELS, grouped as on W&B) drawn from a
run's metrics.jsonl into one PNG, for users without W&B.

    tsp-report RUN_DIR [--out PATH]          writes RUN_DIR/report.png by default

After a resume metrics.jsonl may hold a step twice; the last line of a step wins (it is the one the
continued run produced). Panels whose metrics the run never logged (MFU on a CPU without
logging.peak_tflops, eval loss without eval_every) are listed under the figure instead of drawn
empty. matplotlib is imported inside render_report (Agg backend, no display needed).

The title names every layout the run trained under, with its steps (layouts.jsonl: one line per
launch, written by the trainer); "per GPU" panels say "per process" for a CPU run; memory axes
start at 0, so a flat line reads as flat.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from tsp_trainer.observability.metric_names import PANEL_GROUPS, Panel, expand, panels_in_group

COLUMNS = 4          # panels per row


def read_metrics(path: str | Path) -> dict[int, dict]:
    """step -> metrics of metrics.jsonl, the last line of each step winning (resumed runs)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path} does not exist: pass a run folder (train.output_dir) that has "
                         "metrics.jsonl (logging.jsonl=true)")
    steps: dict[int, dict] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            steps[int(record.pop("step"))] = record
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path}:{number} is not a metrics line ({err!r})") from None
    if not steps:
        raise ValueError(f"{path} holds no metrics yet")
    return dict(sorted(steps.items()))


def series(steps: dict[int, dict], name: str) -> tuple[list[int], list[float]]:
    """(steps, values) where `name` was logged with a finite number."""
    xs, ys = [], []
    for step, record in steps.items():
        value = record.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            xs.append(step)
            ys.append(float(value))
    return xs, ys


def _logged_names(steps: dict[int, dict]) -> list[str]:
    names = {n for record in steps.values() for n, v in record.items() if v is not None}
    return sorted(names)


def render_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw every panel with data into one PNG; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    steps = read_metrics(run_dir / "metrics.jsonl")
    logged = _logged_names(steps)
    rows, missing = _pack_rows(logged)
    fig = plt.figure(figsize=(4.2 * COLUMNS, 3.0 * len(rows) + 1.0), layout="constrained")
    note = f"\nnot logged in this run: {', '.join(missing)}" if missing else ""
    launches = read_layouts(run_dir, last_step=max(steps))
    fig.suptitle(_title(run_dir, steps, launches) + note, fontsize=11)
    per = _per_device(launches)
    subfigs = fig.subfigures(len(rows), 1, squeeze=False)[:, 0]
    for subfig, row in zip(subfigs, rows):
        groups = list(dict.fromkeys(panel.group for panel, _ in row))
        subfig.suptitle(" · ".join(groups), x=0.01, ha="left", fontsize=11, fontweight="bold")
        axes = subfig.subplots(1, COLUMNS, squeeze=False)[0]
        for ax, (panel, names) in zip(axes, row):
            _draw(ax, panel, names, steps, title=panel.title.replace("per GPU", per))
        for ax in axes[len(row):]:
            ax.set_visible(False)
    out = Path(out) if out is not None else run_dir / "report.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def _pack_rows(logged: list[str]) -> tuple[list[list[tuple[Panel, list[str]]]], list[str]]:
    """Rows of at most COLUMNS panels, in group order; a group that fits in the row's free
    columns joins it, a larger one starts new rows. Also the titles of panels with no data."""
    rows: list[list[tuple[Panel, list[str]]]] = [[]]
    missing = []
    for group in PANEL_GROUPS:
        # tables (eval/loss_by_position, eval/passkey) are not series over steps: W&B and
        # tsp-eval's PNGs draw them
        drawn = [(p, expand(p.metrics, logged)) for p in panels_in_group(group) if not p.table]
        missing += [p.title for p, names in drawn if not names]
        drawn = [(p, names) for p, names in drawn if names]
        if not drawn:
            continue
        if len(drawn) > COLUMNS - len(rows[-1]) and rows[-1]:
            rows.append([])
        for item in drawn:
            if len(rows[-1]) == COLUMNS:
                rows.append([])
            rows[-1].append(item)
    return [row for row in rows if row], missing


def _draw(ax, panel: Panel, names: list[str], steps: dict[int, dict], *, title: str) -> None:
    family = any("*" in m for m in panel.metrics)
    for name in names:
        xs, ys = series(steps, name)
        sparse = panel.points or len(xs) < 0.5 * len(steps)   # e.g. eval every N steps: points
        label = name.removeprefix("comm/").removesuffix("_bytes") if family else name
        ax.plot(xs, ys, marker="o" if sparse else None, markersize=3, label=label,
                linewidth=0 if panel.points else 1.2)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    if panel.log_y:
        ax.set_yscale("log")
    elif all(name.startswith("mem/") for name in names):
        ax.set_ylim(bottom=0)          # from 0: a steady 0.5 GiB is not a rise from 0.52
    if len(names) > 4:              # many series: the legend goes beside the plot
        ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))
    elif len(names) > 1:
        ax.legend(fontsize=6, loc="best")


def _title(run_dir: Path, steps: dict[int, dict], launches: list[dict]) -> str:
    first, last = min(steps), max(steps)
    layouts = _layouts_note(launches) if launches else _layout_note(run_dir)
    return f"{run_dir.resolve().name}: steps {first}-{last}{_loss_note(steps)}{layouts}"


def _loss_note(steps: dict[int, dict], k: int = 10) -> str:
    """The eval loss, first and last; else the means of the first and last k logged training
    losses (one step's loss is one batch's: too noisy to compare)."""
    xs, ys = series(steps, "eval/loss")
    if ys:
        return f", eval loss {ys[0]:.3f} (step {xs[0]}) -> {ys[-1]:.3f} (step {xs[-1]})"
    xs, ys = series(steps, "train/loss")
    if not ys:
        return ""
    k = min(k, max(1, len(ys) // 2))
    return (f", train loss {sum(ys[:k]) / k:.3f} -> {sum(ys[-k:]) / k:.3f} (means of the first and last "
            f"{k} logged)")


def read_layouts(run_dir: Path, *, last_step: int) -> list[dict]:
    """layouts.jsonl's launches, each with the steps it ran (first_step .. the next launch's first
    step - 1, the last one up to `last_step`); [] for a run folder without the file."""
    path = run_dir / "layouts.jsonl"
    if not path.is_file():
        return []
    launches = []
    for line in path.read_text().splitlines():
        try:
            launches.append(json.loads(line))
        except ValueError:
            continue
    for launch, following in zip(launches, launches[1:] + [None]):
        launch["last_step"] = following["first_step"] - 1 if following else last_step
    return [launch for launch in launches if launch["last_step"] >= launch["first_step"]]


def _layouts_note(launches: list[dict]) -> str:
    """' | tsp D 2 x dp 2 (steps 1-60), tsp D 1 x dp 4 (steps 61-80), cpu': consecutive launches
    under one layout merged."""
    merged: list[dict] = []
    for launch in launches:
        key = {k: launch.get(k) for k in ("scheme", "tsp_degree", "dp_degree", "zero_stage")}
        if merged and merged[-1]["key"] == key:
            merged[-1]["last_step"] = launch["last_step"]
        else:
            merged.append({"key": key, "first_step": launch["first_step"], "last_step": launch["last_step"]})
    parts = [f"{m['key']['scheme']} D {m['key']['tsp_degree']} x dp {m['key']['dp_degree']} ZeRO-"
             f"{m['key']['zero_stage']} (steps {m['first_step']}-{m['last_step']})" for m in merged]
    devices = sorted({launch.get("device", "?") for launch in launches})
    return f" | {', '.join(parts)} | {'/'.join(devices)}"


def _per_device(launches: list[dict]) -> str:
    """What the per-device panels are per: 'per process' on a CPU run (no GPU in it)."""
    devices = {launch.get("device") for launch in launches}
    if devices == {"cpu"}:
        return "per process"
    return "per GPU" if devices == {"cuda"} else "per rank"


def _layout_note(run_dir: Path) -> str:
    """Model size and mesh from the run's config.yaml, if present (plain text scan: no YAML
    library needed for two values)."""
    config = run_dir / "config.yaml"
    if not config.is_file():
        return ""
    found = {}
    section = None
    for line in config.read_text().splitlines():
        if line and not line.startswith((" ", "#")):
            section = line.rstrip(":")
        elif section in ("model", "parallel") and ":" in line:
            key, _, value = line.strip().partition(":")
            found[f"{section}.{key}"] = value.strip()
    parts = [f"model {found['model.size']}" if "model.size" in found else "",
             f"{found.get('parallel.scheme', '')} dp {found.get('parallel.dp_degree', '?')} x "
             f"D {found.get('parallel.tsp_degree', '?')}" if "parallel.scheme" in found else ""]
    return "".join(f" | {p}" for p in parts if p)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tsp-report", description="Draw a run's metrics.jsonl "
                                     "as the dashboard's panels, in one PNG (no W&B needed).")
    parser.add_argument("run_dir", help="the run folder (train.output_dir)")
    parser.add_argument("--out", help="PNG path (default RUN_DIR/report.png)")
    args = parser.parse_args(argv)
    try:
        path = render_report(args.run_dir, args.out)
    except ValueError as err:
        print(f"tsp-report: error: {err}", file=sys.stderr)
        return 2
    print(f"tsp-report: wrote {path}")
    return 0
