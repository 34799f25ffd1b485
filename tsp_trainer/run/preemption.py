"""Stopping early on purpose: a preemption signal, Ctrl-C, or the end of the allocation.

A signal handler only sets a flag (it may run in the middle of a collective; nothing else is safe
there). At every step boundary all ranks agree with one MAX all-reduce over the world group, so a
signal that reached one rank only (or one node first) stops every rank after the same step; the
Trainer then writes a checkpoint and the process exits with EXIT_PREEMPTED.

SIGINT (Ctrl-C) is always such a stop request, whatever train.preempt_signals says, and the process
then exits 130 (128 + SIGINT, as a shell reports an interrupted command). A terminal's Ctrl-C
reaches the launcher and every rank at once, and the launcher forwards it to the ranks again
within moments: a SIGINT within SECOND_INTERRUPT_AFTER_S of the first is the same request. A later
one is a second Ctrl-C: the process stops at once, without the checkpoint, with one line.

    stopper = StopAgreement(mesh.world, signals=("SIGTERM", "SIGUSR1"), max_runtime_s=3600, device=dev)
    with stopper:                              # installs the handlers, restores them on exit
        while ...:
            train_step()
            reason = stopper.agree(step_s=..., save_s=...)    # collective
            if reason: save(); break

Bad training data found mid-run by one rank's loader (a DataError: file and line) is agreed the
same way, at the start of the step that would read it (`agree_on_batches`): every rank raises it,
rank 0 prints it, every rank exits 2 without a checkpoint of the step (the latest one is kept).

train.max_runtime_min counts from the start of this process (its age is read from /proc on
Linux, so start-up counts as it does for the allocation) and fires when the time left is less than
the slowest step so far plus the slowest save so far, so the final checkpoint still fits.

Under a launcher (accelerate launch, torchrun) the signal usually reaches the launcher: torch
elastic forwards the signals in TORCHELASTIC_SIGNALS_TO_HANDLE (SIGTERM, SIGINT, SIGHUP, SIGQUIT;
add SIGUSR1 with PET_SIGNALS_TO_HANDLE) to every worker and SIGKILLs them after
TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (default 30): that must cover one step plus one save
(docs/reliability.md "Preemption").
"""

from __future__ import annotations

import os
import signal
import threading
import time

from typing import Callable

import torch

from tsp_trainer.data.read_errors import DataError
from tsp_trainer.parallel.comm import Comm

# sysexits.h EX_TEMPFAIL: "temporary failure, the user is invited to retry": the run stopped at a
# checkpoint and continues with train.resume=auto.
EXIT_PREEMPTED = 75
EXIT_INTERRUPTED = 128 + signal.SIGINT     # 130: stopped at a checkpoint after Ctrl-C
SECOND_INTERRUPT_AFTER_S = 2.0

# The code each rank contributes to the MAX all-reduce: 0 = carry on, 1 = out of time, else the
# signal number (so a signal wins over the clock, and its name survives the reduction).
_OUT_OF_TIME = 1


class StopAgreement:
    """Preemption flag (set by signals) + max-runtime clock, agreed by all ranks at step boundaries."""

    def __init__(self, world: Comm, *, signals: tuple[str, ...] | list[str], max_runtime_s: float = 0.0,
                 device: torch.device | str = "cpu", clock=time.monotonic):
        self.world = world
        self.signals = tuple(signals)
        self.max_runtime_s = float(max_runtime_s)
        self.device = torch.device(device)
        self._clock = clock
        self._start = clock() - (process_age_s() if clock is time.monotonic else 0.0)
        self._received: int = 0              # signal number of the first signal caught, 0 if none
        self._interrupted_at: float | None = None   # time.monotonic() of the first SIGINT
        self._agreed: int = 0                # the code every rank agreed on (a signal number, or 1)
        self._previous: dict[int, object] = {}

    # -- signal handlers --------------------------------------------------------------------------
    def __enter__(self) -> StopAgreement:
        if threading.current_thread() is not threading.main_thread():
            return self          # Python delivers signals to the main thread only; the clock still works
        for name in self.signals:
            signum = getattr(signal, name)
            self._previous[signum] = signal.signal(signum, self._on_signal)
        self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_interrupt)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _on_signal(self, signum, frame) -> None:
        # Runs between two bytecodes of the main thread: set the flag, nothing else.
        if not self._received:
            self._received = signum

    def _on_interrupt(self, signum, frame) -> None:
        now = time.monotonic()
        if self._interrupted_at is None:
            self._interrupted_at = now
            self._on_signal(signum, frame)
        elif now - self._interrupted_at >= SECOND_INTERRUPT_AFTER_S:
            stop_at_once(say=self.world.rank == 0)

    @property
    def exit_code(self) -> int:
        """The exit status of a run this agreement stopped: 130 after Ctrl-C, else 75."""
        return EXIT_INTERRUPTED if self._agreed == signal.SIGINT else EXIT_PREEMPTED

    @property
    def received(self) -> str | None:
        return signal.Signals(self._received).name if self._received else None

    # -- the decision -----------------------------------------------------------------------------
    def out_of_time(self, *, step_s: float, save_s: float) -> bool:
        """True when the time left is less than one more step plus the final save."""
        if self.max_runtime_s <= 0:
            return False
        return self._clock() - self._start + step_s + save_s >= self.max_runtime_s

    def agree(self, *, step_s: float, save_s: float) -> str | None:
        """Collective (world): why every rank stops after this step, or None to carry on."""
        code = self._received or (_OUT_OF_TIME if self.out_of_time(step_s=step_s, save_s=save_s) else 0)
        flag = torch.tensor([float(code)], device=self.device)
        self.world.all_reduce(flag, tag="lifecycle.stop", op=torch.distributed.ReduceOp.MAX)
        code = self._agreed = int(flag.item())
        if code == 0:
            return None
        if code == _OUT_OF_TIME:
            return (f"train.max_runtime_min={self.max_runtime_s / 60:g} reached (the next step and "
                    "the final save would not fit)")
        return f"signal {signal.Signals(code).name}"


def stop_at_once(*, say: bool) -> None:
    """A second Ctrl-C: one line (from rank 0: `say`), release the run folder, exit 130 now (no
    checkpoint, no traceback). os.write: this runs in a signal handler, maybe inside a print."""
    if say:
        os.write(2, b"tsp-train: second Ctrl-C: stopping now, without a checkpoint of this step\n")
    from tsp_trainer.run.lease import release_held

    release_held()
    os._exit(EXIT_INTERRUPTED)


class AgreedDataError(DataError):
    """Bad training data, found by one rank's loader and known to every rank (`agreed`): each
    raises it, the CLI prints it from rank 0 only and every rank exits 2."""

    agreed = True


def agree_on_batches(world: Comm, read: Callable[[], list], *, device: torch.device) -> list:
    """Collective (world), at the start of a step, before its first collective: this rank's
    micro-batches from `read()`, or, when any rank's read met bad data (a DataError: one DP
    replica's file, the others' fine), that rank's message raised on every rank. Without it the
    failing rank would leave while its peers wait in the step's collectives: CommError tracebacks
    and mixed exit codes. One small MAX all-reduce per step; the messages are gathered only then."""
    try:
        batches, error = read(), None
    except DataError as err:
        batches, error = [], err
    flag = torch.tensor([float(error is not None)], device=device)
    world.all_reduce(flag, tag="lifecycle.data", op=torch.distributed.ReduceOp.MAX)
    if not flag.item():
        return batches
    reports = world.all_gather_object(None if error is None else str(error))
    raise AgreedDataError(next(text for text in reports if text)) from error


def process_age_s() -> float:
    """Seconds since this process started (Linux /proc; 0 where it cannot be read)."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])    # field 22: starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0
