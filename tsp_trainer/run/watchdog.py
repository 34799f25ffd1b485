"""Hang watchdog: when one training step runs longer than train.hang_dump_s, dump what this rank is
doing, before the collective timeout (train.collective_timeout_s, larger) ends the job.

The dump goes to the rank's stderr (its log under any launcher) and to
<output_dir>/hang_dumps/rank_XXXXX.txt, and holds:
    - one header line: rank, step, how long it has run, the threshold;
    - the communication ops in flight on this rank (parallel/comm.py records them in
      ledger.in_flight: op, tag, bytes, axis, this rank, the peers, and for how long), which names
      the collective a stalled peer is holding up;
    - the Python stack of every thread (faulthandler.dump_traceback).
A stalled rank (SIGSTOP, a hung kernel) cannot dump itself; its peers' dumps name it as the peer
they wait for. One dump per step: a step that stays stuck is dumped once.

The watchdog is a daemon thread; faulthandler writes from C and the collectives release the GIL
while they wait, so it runs while the main thread is blocked in gloo or NCCL.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable, TextIO


class HangWatchdog:
    def __init__(self, *, dump_after_s: float, rank: int, in_flight: Callable[[], list[str]],
                 dump_dir: str | os.PathLike | None, stream: TextIO | None = None):
        self.dump_after_s = float(dump_after_s)
        self.rank = rank
        self._in_flight = in_flight
        self._dump_path = None if dump_dir is None else Path(dump_dir) / f"rank_{rank:05d}.txt"
        self._stream = stream if stream is not None else sys.stderr
        self._step: int | None = None
        self._started = 0.0
        self._dumped_step: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.dumps = 0                      # how many dumps this watchdog wrote (tests read it)

    @property
    def enabled(self) -> bool:
        return self.dump_after_s > 0

    # -- lifetime ---------------------------------------------------------------------------------
    def __enter__(self) -> HangWatchdog:
        if self.enabled:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="tsp-hang-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    # -- the training thread's side ---------------------------------------------------------------
    def step_started(self, step: int) -> None:
        self._started = time.monotonic()
        self._step = step

    def step_finished(self) -> None:
        self._step = None

    # -- the watchdog thread ----------------------------------------------------------------------
    def _run(self) -> None:
        poll = min(1.0, self.dump_after_s / 4)
        while not self._stop.wait(poll):
            step = self._step
            if step is None or step == self._dumped_step:
                continue
            elapsed = time.monotonic() - self._started
            if elapsed > self.dump_after_s and self._step == step:
                self._dumped_step = step
                self.dump(step, elapsed)

    def dump(self, step: int, elapsed: float) -> None:
        ops = self._in_flight() or ["none recorded (the step is not waiting in a collective of ours)"]
        lines = [f"[rank {self.rank}] hang watchdog: step {step} has run {elapsed:.1f} s "
                 f"(train.hang_dump_s={self.dump_after_s:g}); communication in flight:"]
        lines += [f"[rank {self.rank}]   {op}" for op in ops]
        lines.append(f"[rank {self.rank}] Python stacks of all threads:")
        header = "\n".join(lines) + "\n"
        self._write(self._stream, header)
        if self._dump_path is not None:
            self._dump_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self._dump_path, "a", encoding="utf-8") as f:
                self._write(f, header)
        self.dumps += 1

    @staticmethod
    def _write(stream: TextIO, header: str) -> None:
        stream.write(header)
        stream.flush()
        try:
            faulthandler.dump_traceback(file=stream, all_threads=True)
        except (ValueError, OSError, AttributeError):      # a stream without a file descriptor
            import traceback

            for thread_id, frame in sys._current_frames().items():
                stream.write(f"Thread {thread_id:#x}:\n" + "".join(traceback.format_stack(frame)))
        stream.flush()
