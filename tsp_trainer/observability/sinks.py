"""Metric sinks: where one dict of metrics per logged step goes (metrics.jsonl, the console, W&B).
Sinks never communicate; the caller builds real sinks on global rank 0 only (make_sinks) and a
NullSink everywhere else. wandb is imported only by wandb_sink.py, lazily.

Metric names and what each means: observability/metric_names.py. The console line shows the rows
with a `console` format (loss, lr, grad norm, eval loss, tok/s, MFU, step time, memory); every
metric goes to the JSONL file and W&B.
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import IO, Any, Iterable, Protocol, runtime_checkable

from tsp_trainer.observability.log import get_logger
from tsp_trainer.observability.metric_names import console_metrics, metric_def
from tsp_trainer.observability.wandb_sink import WANDB_MODES, WandbSink


@runtime_checkable
class MetricsSink(Protocol):
    def log(self, step: int, metrics: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def _to_json_value(value: Any) -> Any:
    """Python scalars as-is; 0-d tensors / numpy scalars via .item(); NaN and inf as null (strict JSON)."""
    if hasattr(value, "item") and callable(value.item):
        try:
            value = value.item()
        except (ValueError, RuntimeError):   # not a scalar: json.dumps(default=str) prints it
            return value
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class NullSink:
    """Accepts everything, writes nothing: ranks != 0, and tests that do not look at metrics."""

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        pass

    def mark_preempting(self) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlSink:
    """One JSON object per line, {"step": step, **metrics}, flushed after each line so tools and
    tests can read the file while training runs.

    The file is opened in append mode. The Trainer first cuts it back to the step it resumes from
    (run/rundir.py rewrite_metrics), so the steps replayed after a crash appear once. Non-finite
    floats are written as null so every line is strict JSON.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._file: IO[str] | None = open(self.path, "a", encoding="utf-8")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if self._file is None:
            raise RuntimeError(f"JsonlSink({self.path!r}).log called after close")
        record = {"step": int(step), **{k: _to_json_value(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record, allow_nan=False, default=str) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _si(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{unit}"
    return f"{value:.1f}"


def format_console_line(step: int, metrics: dict[str, Any]) -> str:
    """"step 12 | loss 3.4568 | lr 3.00e-04 | gnorm 1.234 | 12.35k tok/s | MFU 41.2% | 0.35 s/step |
    mem 12.3 GiB", in the order of metric_names.METRICS; missing or None fields are left out."""
    m = {k: _to_json_value(v) for k, v in metrics.items()}
    parts = [f"step {step}"]
    for row in console_metrics():
        value = m.get(row.name)
        if value is None:
            continue
        if "{si}" in row.console:
            parts.append(row.console.replace("{si}", _si(value)))
        else:
            parts.append(row.console.format(value * row.scale))
    return " | ".join(parts)


class ConsoleSink:
    """One compact line per logged step through the package logger (so a progress bar can redirect
    it, see progress.py)."""

    def __init__(self, logger: logging.LoggerAdapter | logging.Logger | None = None):
        self._logger = logger if logger is not None else get_logger("tsp_trainer.metrics")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self._logger.info(format_console_line(step, metrics))

    def close(self) -> None:
        pass


class MultiSink:
    """Fans out to several sinks. close() closes all of them, then re-raises the first error.
    A name missing from metric_names.METRICS is still logged, with one warning per name (the
    dashboard and the report would not show it)."""

    def __init__(self, sinks: Iterable[MetricsSink]):
        self.sinks = list(sinks)
        self._warned: set[str] = set()

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for name in metrics.keys() - self._warned:
            try:
                metric_def(name)
            except KeyError as err:
                self._warned.add(name)
                get_logger(__name__).warning(f"{err.args[0]}; it is logged, but no panel shows it")
        for sink in self.sinks:
            sink.log(step, metrics)

    def mark_preempting(self) -> None:
        for sink in self.sinks:
            if hasattr(sink, "mark_preempting"):
                sink.mark_preempting()

    def close(self) -> None:
        errors = []
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:  # keep closing the others (W&B must still finish)
                errors.append(exc)
        if errors:
            raise errors[0]


def make_sinks(*, global_rank: int, wandb_mode: str, project: str, run_name: str, config: dict[str, Any],
               output_dir: str | os.PathLike, jsonl: bool = True, console: bool = True,
               wandb_run_id: str | None = None, wandb_options: dict[str, Any] | None = None) -> MetricsSink:
    """The job's metric sink: NullSink on ranks != 0; on global rank 0 a MultiSink of
    JsonlSink(output_dir/metrics.jsonl), ConsoleSink and WandbSink (unless wandb_mode="disabled";
    its files go under output_dir/wandb). wandb_run_id names the W&B run; wandb_options are the
    other WandbSink keywords (entity, group, tags, continues, skip_through_step, rewind_to_step)."""
    if wandb_mode not in WANDB_MODES:
        raise ValueError(f"logging.wandb_mode={wandb_mode!r} is not one of {WANDB_MODES}")
    if global_rank != 0:
        return NullSink()
    output_dir = os.fspath(output_dir)
    sinks: list[MetricsSink] = []
    if jsonl:
        sinks.append(JsonlSink(os.path.join(output_dir, "metrics.jsonl")))
    if console:
        sinks.append(ConsoleSink())
    if wandb_mode != "disabled":
        sinks.append(WandbSink(project, run_name=run_name, config=config, mode=wandb_mode,
                               dir=output_dir, run_id=wandb_run_id, **(wandb_options or {})))
    return MultiSink(sinks)
