"""The metric vocabulary: one table of every metric the Trainer logs, with its unit, the W&B summary
it keeps, the dashboard panel group it belongs to and what it means. The sinks, the console line,
W&B (`define_metric`), the dashboard (dashboard.py) and the offline report (report.py) all read
this table, so a metric is added or renamed here and nowhere else. Standard library only.

Names are `<group>/<name>`. `comm/<axis>/<op>_bytes` is a family: one metric per (mesh axis,
op) pair the communication ledger saw in the step (e.g. `comm/tsp/broadcast_bytes`). Other
engineers' metrics (e.g. `data/epoch`) are rows of the same table.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

# Panel groups, in the order dashboards and reports show them.
PANEL_GROUPS = ("train", "eval", "perf", "mem", "comm", "data")


@dataclass(frozen=True)
class MetricDef:
    name: str              # "train/loss", or a glob for a family ("comm/*/*_bytes")
    unit: str              # what one unit of the value is
    summary: str           # what W&B keeps in the run summary: "min" | "max" | "mean" | "last"
    panel: str             # one of PANEL_GROUPS
    description: str       # one line for docs, dashboards and reports
    console: str | None = None   # format on the console line ("loss {:.4f}"); None = not shown
    scale: float = 1.0     # the console shows value * scale

    @property
    def is_family(self) -> bool:
        return "*" in self.name


METRICS: tuple[MetricDef, ...] = (
    MetricDef("train/loss", "nats/token", "min", "train",
              "mean cross-entropy over every valid token of the global batch", "loss {:.4f}"),
    MetricDef("train/lr", "1", "last", "train", "learning rate the step's update used", "lr {:.2e}"),
    MetricDef("train/grad_norm", "1", "last", "train",
              "global L2 norm of the gradient before clipping", "gnorm {:.3f}"),
    MetricDef("train/skipped", "0/1", "max", "train",
              "1 if this step's update was skipped (non-finite loss or gradient)"),
    MetricDef("train/skipped_steps", "steps", "last", "train", "updates skipped so far in the run"),
    MetricDef("train/tokens_seen", "tokens", "last", "train", "global tokens consumed so far"),
    MetricDef("eval/loss", "nats/token", "min", "eval",
              "mean cross-entropy on train.eval_batches held-out micro-batches per dp rank", "eval {:.4f}"),
    MetricDef("eval/loss_by_position", "nats/token", "last", "eval",
              "table: eval/loss per position bucket [0], [1], [2, 3], ... up to data.seq_len; a "
              "token's position inside its document with data.document_masking and "
              "data.reset_positions, inside its row otherwise "
              "(eval.loss_by_position; W&B also draws it as a line chart, <name>_chart)"),
    MetricDef("eval/passkey_accuracy", "fraction", "max", "eval",
              "passkey retrieval: share of haystacks whose every key token is the argmax, mean over "
              "the eval.passkey_lengths x eval.passkey_depths cells (every eval.passkey_every steps)"),
    MetricDef("eval/passkey", "fraction", "last", "eval",
              "table: passkey accuracy, key-token accuracy and key loss per (length, depth) cell"),
    MetricDef("perf/tokens_per_s", "tokens/s", "mean", "perf", "global tokens per second of the step",
              "{si} tok/s"),
    MetricDef("perf/tokens_per_s_per_gpu", "tokens/s", "mean", "perf",
              "tokens per second per device (world = dp x tsp; every TSP rank works on the same tokens)"),
    MetricDef("perf/tflops_per_gpu", "TFLOP/s", "mean", "perf",
              "model FLOP/s per device (observability/flops.py), in units of 1e12"),
    MetricDef("perf/mfu", "fraction", "mean", "perf",
              "model FLOPs utilisation: model FLOP/s per device / peak FLOP/s of the device",
              "MFU {:.1f}%", 100.0),
    MetricDef("perf/hfu", "fraction", "mean", "perf",
              "hardware FLOPs utilisation: MFU counting what activation checkpointing recomputes"),
    MetricDef("perf/step_time_s", "s", "mean", "perf", "wall time of the optimizer step on rank 0",
              "{:.2f} s/step"),
    MetricDef("perf/step_time_max_rank", "s", "max", "perf",
              "slowest rank's own step time: wall time minus time blocked in communication "
              "(gathered every logging.rank_stats_every steps)"),
    MetricDef("perf/slowest_rank", "rank", "last", "perf",
              "global rank whose own step time is perf/step_time_max_rank"),
    MetricDef("perf/data_wait_s", "s", "mean", "perf", "time rank 0 waited for its batches in the step"),
    MetricDef("perf/data_wait_max_rank", "s", "max", "perf",
              "longest data wait of any rank in the step (gathered with perf/step_time_max_rank)"),
    MetricDef("perf/checkpoint_stall_s", "s", "max", "perf",
              "time the training loop was blocked by checkpointing in the step (snapshot, write "
              "when synchronous, publish)"),
    MetricDef("mem/peak_gib", "GiB", "max", "mem",
              "peak memory of the step: CUDA allocator peak (reset every step) on GPU, the "
              "process's max RSS since start on CPU", "mem {:.1f} GiB"),
    MetricDef("comm/*/*_bytes", "bytes", "mean", "comm",
              "payload bytes of one op on one mesh axis in the step, from the communication ledger "
              "(comm/<axis>/<op>_bytes; DeepSpeed's own dp reductions are not in the ledger)"),
    MetricDef("data/epoch", "epochs", "last", "data", "passes over the training data so far"),
    MetricDef("data/seq_len", "tokens", "last", "data",
              "sequence length of the step (the stage of data.seq_len_schedule; FLOPs follow it)"),
)

_BY_NAME = {m.name: m for m in METRICS if not m.is_family}
_FAMILIES = [m for m in METRICS if m.is_family]


def metric_def(name: str) -> MetricDef:
    """The table row of a logged name (a family matches by glob); KeyError names the table."""
    if name in _BY_NAME:
        return _BY_NAME[name]
    for family in _FAMILIES:
        if fnmatch.fnmatchcase(name, family.name):
            return family
    raise KeyError(f"metric {name!r} is not in observability/metric_names.py METRICS; add a row")


def comm_metric_name(axis: str, op: str) -> str:
    return f"comm/{axis}/{op}_bytes"


def console_metrics() -> list[MetricDef]:
    """Rows shown on the console line, in table order."""
    return [m for m in METRICS if m.console]


@dataclass(frozen=True)
class Panel:
    """One chart of the dashboard and of the offline report: metrics drawn together (names, or one
    family glob expanded against what a run logged)."""

    title: str
    metrics: tuple[str, ...]
    log_y: bool = False
    points: bool = False       # markers only (a categorical value such as a rank id)
    table: bool = False        # a MetricTable (observability/tables.py): W&B shows the table itself

    @property
    def group(self) -> str:
        return metric_def(self.metrics[0]).panel


PANELS: tuple[Panel, ...] = (
    Panel("loss", ("train/loss", "eval/loss")),
    Panel("learning rate", ("train/lr",)),
    Panel("gradient norm (before clipping)", ("train/grad_norm",)),
    Panel("skipped updates: total, this step", ("train/skipped_steps", "train/skipped")),
    Panel("tokens seen", ("train/tokens_seen",)),
    Panel("eval loss", ("eval/loss",)),
    Panel("eval loss by position (last evaluation)", ("eval/loss_by_position",), table=True),
    Panel("passkey accuracy", ("eval/passkey_accuracy",)),
    Panel("passkey accuracy by length and depth (last run)", ("eval/passkey",), table=True),
    Panel("tokens/s", ("perf/tokens_per_s",)),
    Panel("tokens/s per GPU", ("perf/tokens_per_s_per_gpu",)),
    Panel("TFLOP/s per GPU", ("perf/tflops_per_gpu",)),
    Panel("MFU / HFU", ("perf/mfu", "perf/hfu")),
    Panel("step time (s): rank 0 and slowest rank's own", ("perf/step_time_s", "perf/step_time_max_rank")),
    Panel("slowest rank", ("perf/slowest_rank",), points=True),
    Panel("data wait (s): rank 0 and longest", ("perf/data_wait_s", "perf/data_wait_max_rank")),
    Panel("checkpoint stall (s)", ("perf/checkpoint_stall_s",)),
    Panel("peak memory (GiB)", ("mem/peak_gib",)),
    Panel("communication bytes per step, by axis/op", ("comm/*/*_bytes",), log_y=True),
    Panel("epoch", ("data/epoch",)),
    Panel("sequence length", ("data/seq_len",)),
)


def panels_in_group(group: str) -> list[Panel]:
    return [p for p in PANELS if p.group == group]


def expand(patterns: tuple[str, ...], logged: list[str]) -> list[str]:
    """The logged names a panel draws: names as they are, families matched against `logged`."""
    out = []
    for pattern in patterns:
        if "*" in pattern:
            out += sorted(n for n in logged if fnmatch.fnmatchcase(n, pattern))
        elif pattern in logged:
            out.append(pattern)
    return out
