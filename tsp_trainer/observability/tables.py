"""A metric that is a table rather than a number (e.g. the eval loss per position bucket), with an
optional line chart of two of its columns. Put one in a step's metrics dict like any value; each
sink renders it: metrics.jsonl writes {"columns": [...], "rows": [[...], ...]}, W&B logs a
wandb.Table under the key and, with `line`, a line chart under "<key>_chart" (wandb_sink.py), and
the console line leaves it out. Standard library only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LineChart:
    x: str                   # column on the x axis
    y: str                   # column on the y axis
    title: str


@dataclass(frozen=True)
class MetricTable:
    columns: tuple[str, ...]
    rows: tuple[tuple[Any, ...], ...]
    line: LineChart | None = None

    def __post_init__(self):
        for row in self.rows:
            if len(row) != len(self.columns):
                raise ValueError(f"table row {row} has {len(row)} values for columns {self.columns}")
        if self.line is not None:
            missing = {self.line.x, self.line.y} - set(self.columns)
            if missing:
                raise ValueError(f"line chart column(s) {sorted(missing)} not in {self.columns}")

    def to_json(self) -> dict[str, Any]:
        """Strict JSON: non-finite floats become null (as JsonlSink does for scalars)."""
        return {"columns": list(self.columns),
                "rows": [[None if isinstance(v, float) and not math.isfinite(v) else v for v in row]
                         for row in self.rows]}

    def column(self, name: str) -> list[Any]:
        i = self.columns.index(name)
        return [row[i] for row in self.rows]
