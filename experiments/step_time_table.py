"""TSP's step time over TP's for each recompute mode, at several degrees and lengths: the table of
docs/benchmarks.md "Recompute modes".

Each cell is one tsp-bench launch of TSP and TP on the same weights and batch whose timed steps
are interleaved (TSP step i next to TP step i), so a drift of the machine's speed hits both; the
cell is the median of the per-step ratios with their min-max range. The cells run one after the
other in the order of the table (modes innermost), so a slow minute shows as one odd cell, not as
one odd column. With --launches N the whole table runs N times, round after round; a cell is then
the median of its N launch medians with their min-max range, the per-launch cells beside it.

    python experiments/step_time_table.py --degrees 2,4 --seq-lens 4096,8192 \
        --modes full,selective,none --steps 3 --json docs/results/step_time_table.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tsp_trainer.bench.report import format_spread, spread

# The benchmark model of docs/benchmarks.md: h 256, 4 layers, 4 MHA heads, I 688, V 2048.
MODEL = ["--model", "tiny", "--hidden", "256", "--layers", "4", "--heads", "4", "--kv-heads", "4",
         "--intermediate", "688", "--vocab", "2048", "--schemes", "tsp,tp", "--threads", "1", "--no-hf"]


def run_cell(degree: int, seq_len: int, mode: str, steps: int) -> dict:
    """One tsp-bench launch; its TSP-over-TP ratios step by step, and the median step times."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cell.json"
        argv = [sys.executable, "-m", "tsp_trainer", "bench", *MODEL, "--degree", str(degree),
                "--seq-len", str(seq_len), "--steps", str(steps), "--tsp-recompute", mode,
                "--json", str(out)]
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        doc = json.loads(out.read_text())
    times = {r["scheme"]: r["step_time"] for r in doc["schemes"]}
    return {"degree": degree, "seq_len": seq_len, "mode": mode, "steps": steps,
            "ratio": doc["step_time_over_tp_by_step"]["tsp"], "tsp_s": times["tsp"], "tp_s": times["tp"]}


def combine(launches: list[dict]) -> dict:
    """One cell from the same cell's launches: the median of their medians, with their min-max."""
    if len(launches) == 1:
        return launches[0]
    first = launches[0]
    return {"degree": first["degree"], "seq_len": first["seq_len"], "mode": first["mode"],
            "steps": first["steps"], "launches": len(launches),
            "ratio": spread([c["ratio"]["median"] for c in launches]),
            "tsp_s": statistics.median(c["tsp_s"] for c in launches),
            "tp_s": statistics.median(c["tp_s"] for c in launches), "per_launch": launches}


def table(cells: list[dict], modes: list[str]) -> str:
    """Markdown: one row per (degree, length), one column per mode: median [min-max] (TSP s / TP s)."""
    head = "| run | " + " | ".join(f"TSP {m} / TP" for m in modes) + " |"
    lines = [head, "|" + "---|" * (len(modes) + 1)]
    runs = sorted({(c["degree"], c["seq_len"]) for c in cells}, key=lambda k: (k[1], k[0]))
    for degree, seq_len in runs:
        row = [f"D = {degree}, {seq_len // 1024}K"]
        for mode in modes:
            c = next(c for c in cells if (c["degree"], c["seq_len"], c["mode"]) == (degree, seq_len, mode))
            row.append(f"{format_spread(c['ratio'])} ({c['tsp_s']:.2f} / {c['tp_s']:.2f} s)")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--degrees", default="2,4")
    p.add_argument("--seq-lens", default="4096,8192")
    p.add_argument("--modes", default="auto,full,selective,none",
                   help="tsp-bench --tsp-recompute values; auto: the trainer's default choice")
    p.add_argument("--steps", type=int, default=3, help="timed steps per launch (>= 3 for a median)")
    p.add_argument("--launches", type=int, default=1,
                   help="run the table this many times; a cell is the median of its launches")
    p.add_argument("--json", default=None, help="write the cells here")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    keys = [(degree, seq_len, mode) for seq_len in map(int, args.seq_lens.split(","))
            for degree in map(int, args.degrees.split(",")) for mode in modes]
    runs: dict[tuple, list[dict]] = {key: [] for key in keys}
    for _ in range(args.launches):
        for key in keys:
            runs[key].append(run_cell(*key, args.steps))
            print(json.dumps(runs[key][-1]), flush=True)
    cells = [combine(runs[key]) for key in keys]
    print(table(cells, modes))
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(["python", *sys.argv]), "cells": cells},
                                              indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
