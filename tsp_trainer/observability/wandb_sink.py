"""Weights & Biases sink: the only module that imports wandb (lazily, inside WandbSink), built on
global rank 0 only (see sinks.make_sinks). No collectives; the mode comes from the typed config
(logging.wandb_mode). The one environment read is `check_wandb_credentials`, the start-up check
that an online run has credentials, before any process group or file exists.

Modes: "online" (needs network and a login), "offline" (writes <dir>/wandb/offline-run-*, upload
later with `wandb sync`), "disabled" (no files, no child process). Offline runs start a wandb-core
child that exits with the training process. A scheduler that signals every process of the job
(SLURM's preemption, `scancel --signal=TERM`) stops wandb-core too, while the trainer goes on to
its checkpoint: the sink then says so once and logs nothing more (metrics.jsonl keeps every step;
the requeued job logs on to the same run). `dir` is always passed, so
nothing lands in the working directory; wandb-core's own debug logs go to the user cache dir unless
WANDB_CACHE_DIR points elsewhere (a launch-script concern).
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any, Mapping

from tsp_trainer.observability.tables import MetricTable
from tsp_trainer.observability.metric_names import METRICS

WANDB_MODES = ("online", "offline", "disabled")


def _loggable(metrics: dict[str, Any], wandb) -> dict[str, Any]:
    """Drop None (e.g. MFU on CPU) and non-finite floats, which W&B charts cannot draw; a
    MetricTable becomes a wandb.Table (and its line chart, under "<key>_chart")."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, MetricTable):
            out.update(_table(key, value, wandb))
            continue
        if hasattr(value, "item") and callable(value.item):
            try:
                value = value.item()
            except (ValueError, RuntimeError):
                pass
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            continue
        out[key] = value
    return out


def _table(key: str, table: MetricTable, wandb) -> dict[str, Any]:
    data = table.to_json()["rows"]
    out = {key: wandb.Table(columns=list(table.columns), data=data)}
    if table.line is not None:
        # the chart gets a table of its own, without rows the chart cannot draw (empty buckets)
        x, y = table.columns.index(table.line.x), table.columns.index(table.line.y)
        points = [[row[x], row[y]] for row in data if row[x] is not None and row[y] is not None]
        chart = wandb.Table(columns=[table.line.x, table.line.y], data=points)
        out[key + "_chart"] = wandb.plot.line(chart, table.line.x, table.line.y, title=table.line.title)
    return out


DEFAULT_HOST = "https://api.wandb.ai"


def check_wandb_credentials(mode: str, environ: Mapping[str, str] = os.environ) -> None:
    """logging.wandb_mode='online' needs credentials W&B finds without asking, looked for the way
    wandb.init does, without the network: WANDB_API_KEY or WANDB_IDENTITY_TOKEN_FILE in the
    environment, else a netrc entry ($NETRC, else ~/.netrc) for the host (WANDB_BASE_URL, else
    api.wandb.ai). A start-up check: without it the run would fail on rank 0 after start-up, with
    the run folder already written."""
    if mode != "online" or environ.get("WANDB_API_KEY") or environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return
    from wandb.errors import AuthenticationError
    from wandb.sdk.lib.wbauth import read_netrc_auth

    host = environ.get("WANDB_BASE_URL") or DEFAULT_HOST
    netrc = environ.get("NETRC") or "~/.netrc"
    try:
        found = read_netrc_auth(host=host)
    except AuthenticationError as err:
        raise ValueError(f"logging.wandb_mode='online': the W&B API key for {host} in {netrc} is "
                         f"not valid ({err}); run `wandb login --relogin`") from None
    if not found:
        raise ValueError(f"logging.wandb_mode='online' needs W&B credentials and none were found: "
                         f"no WANDB_API_KEY in the environment and no entry for {host} in {netrc}; "
                         "run `wandb login`, export WANDB_API_KEY, or use logging.wandb_mode=offline "
                         "(upload later with `wandb sync`)")


def _refuse_off_rank0() -> None:
    """A safety net for make_sinks's contract: W&B runs on global rank 0 only."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        raise RuntimeError(f"WandbSink built on global rank {dist.get_rank()}; build it on rank 0 only "
                           "(use observability.make_sinks, which returns a NullSink elsewhere)")


def define_metrics(run) -> None:
    """Declare every row of metric_names.METRICS on the run: the summary W&B keeps for it (min loss,
    max memory, ...). W&B takes a glob only as a suffix, so a family (`comm/*/*_bytes`) is
    declared by its prefix (`comm/*`)."""
    for metric in METRICS:
        name = metric.name.split("*")[0] + "*" if metric.is_family else metric.name
        run.define_metric(name, summary=metric.summary)


class WandbSink:
    """Logs each step's metrics to one W&B run; close() finishes the run (idempotent).

    Continuing a run across relaunches (run/identity.py decides which): `run_id` with
    `continues=True` resumes that run (resume="allow") and drops steps <= `skip_through_step`,
    which an earlier launch already logged (W&B would drop them itself, with a warning per step);
    `rewind_to_step` instead truncates the run's history to that step (resume_from, W&B's beta
    "rewind") so the replayed steps are logged again."""

    def __init__(self, project: str, *, run_name: str | None, config: dict[str, Any], mode: str,
                 dir: str | os.PathLike, run_id: str | None = None,  # noqa: A002 (wandb's name)
                 entity: str | None = None, group: str | None = None, tags: list[str] | None = None,
                 continues: bool = False, skip_through_step: int | None = None,
                 rewind_to_step: int | None = None):
        if mode not in WANDB_MODES:
            raise ValueError(f"logging.wandb_mode={mode!r} is not one of {WANDB_MODES}")
        _refuse_off_rank0()
        import wandb

        self._wandb = wandb
        self.dir = os.fspath(dir)
        os.makedirs(self.dir, exist_ok=True)
        # reinit="create_new": this sink owns its run object and never picks up (or finishes)
        # another run that happens to be active in the process.
        kwargs: dict[str, Any] = dict(project=project, entity=entity, group=group, tags=list(tags or []),
                                      name=run_name, config=config, mode=mode, dir=self.dir,
                                      reinit="create_new")
        if rewind_to_step is not None and run_id:
            kwargs["resume_from"] = f"{run_id}?_step={int(rewind_to_step)}"
        else:
            kwargs.update(id=run_id, resume="allow" if (run_id and continues) else None)
        self.run = wandb.init(**kwargs)
        self.skip_through_step = skip_through_step
        define_metrics(self.run)
        self._closed = False
        self._service_gone = False

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if self._closed:
            raise RuntimeError("WandbSink.log called after close")
        if self.skip_through_step is not None and step <= self.skip_through_step:
            return        # replayed after a resume: logged before, with the same values (exact resume)
        self._call(f"step {step}", self.run.log, _loggable(metrics, self._wandb), step=int(step))

    def mark_preempting(self) -> None:
        """Tell W&B the run stops for a preemption (shown as such, and resumed by the relaunch)."""
        self._call("the preemption mark", self.run.mark_preempting)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._call("the end of the run", self.run.finish)

    def _call(self, what: str, fn, *args, **kwargs) -> None:
        """fn(*args, **kwargs) on the run, unless its wandb-core process is gone (killed by a signal
        meant for the whole job: the connection to it fails with an OSError): one line, then
        nothing more is sent."""
        if self._service_gone:
            return
        try:
            fn(*args, **kwargs)
        except OSError as err:             # ConnectionResetError / BrokenPipeError: no service
            self._service_gone = True
            print(f"tsp-train: warning: W&B logging stops at {what}: its wandb-core process is gone "
                  f"({type(err).__name__}: {err}); metrics.jsonl keeps every step", file=sys.stderr,
                  flush=True)
