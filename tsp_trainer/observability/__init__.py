"""Observability: the metric names (metric_names.py, one table), rank-aware logging, FLOP formula and
step metrics (tokens/s, MFU, memory, per-op communication, the slowest rank), metric sinks
(metrics.jsonl, console, W&B on global rank 0), a progress bar, the W&B dashboard as code
(dashboard.py) and the offline report (report.py). The only collective is StepRecorder's rank-stats
gather, through the Comm it is handed; only wandb_sink.py imports wandb and only dashboard.py
wandb_workspaces (both lazily)."""

from tsp_trainer.observability.flops import (
    attention_flops_per_token,
    block_matmul_params,
    flops_per_token,
    matmul_params,
)
from tsp_trainer.observability.log import configure_logging, get_logger
from tsp_trainer.observability.metric_names import METRICS, PANEL_GROUPS, MetricDef, metric_def
from tsp_trainer.observability.metrics import (
    DEVICE_PEAK_FLOPS,
    StepMetrics,
    detect_peak_flops,
    peak_flops_for,
    peak_memory_bytes,
    reset_peak_memory,
)
from tsp_trainer.observability.progress import ProgressBar
from tsp_trainer.observability.recorder import StepRecorder
from tsp_trainer.observability.sinks import (
    ConsoleSink,
    JsonlSink,
    MetricsSink,
    MultiSink,
    NullSink,
    format_console_line,
    make_sinks,
)
from tsp_trainer.observability.tables import LineChart, MetricTable
from tsp_trainer.observability.wandb_sink import WANDB_MODES, WandbSink

__all__ = [
    "DEVICE_PEAK_FLOPS", "METRICS", "PANEL_GROUPS", "MetricDef", "StepRecorder", "metric_def",
    "WANDB_MODES", "ConsoleSink", "JsonlSink", "LineChart", "MetricTable", "MetricsSink", "MultiSink",
    "NullSink",
    "ProgressBar", "StepMetrics", "WandbSink", "attention_flops_per_token", "block_matmul_params",
    "configure_logging", "detect_peak_flops", "flops_per_token", "format_console_line", "get_logger",
    "make_sinks", "matmul_params", "peak_flops_for",
    "peak_memory_bytes", "reset_peak_memory",
]
