"""A worker under torchrun / accelerate launch stops when its launcher dies (SIGKILL, the OOM
killer), instead of training on as an orphan that writes and prunes checkpoints a requeue needs.

Linux: the kernel signals the worker when the launcher (the thread that started it) exits;
everywhere: a daemon thread sees os.getppid() change within PARENT_POLL_S. Either way the process
ends at once: a checkpoint whose publication has not happened is not published (the next save
removes its temporary folder).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable

# Sent to a worker by the kernel when its launcher dies (PR_SET_PDEATHSIG). Not SIGTERM: that is a
# preemption signal, whose handler checkpoints; a real-time signal no recipe can name.
LAUNCHER_GONE_SIGNAL = signal.SIGRTMIN + 1 if hasattr(signal, "SIGRTMIN") else None
_PR_SET_PDEATHSIG = 1               # linux/prctl.h
PARENT_POLL_S = 0.5

_gone_lock = threading.Lock()


def stop_with_launcher(launcher: int, *, on_gone: Callable[[], None]) -> None:
    """Stop this process (after `on_gone`, exit 1) once `launcher`, the pid of its parent when it
    started, is gone; at once if it already is."""
    if sys.platform.startswith("linux") and LAUNCHER_GONE_SIGNAL is not None:
        signal.signal(LAUNCHER_GONE_SIGNAL, lambda signum, frame: launcher_gone(launcher, on_gone))
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(LAUNCHER_GONE_SIGNAL), 0, 0, 0)
    threading.Thread(target=_watch_parent, args=(launcher, on_gone), name="tsp-launcher-watch",
                     daemon=True).start()


def _watch_parent(launcher: int, on_gone: Callable[[], None]) -> None:
    while os.getppid() == launcher:
        threading.Event().wait(PARENT_POLL_S)
    launcher_gone(launcher, on_gone)


def launcher_gone(launcher: int, on_gone: Callable[[], None]) -> None:
    if os.getppid() == launcher:    # PDEATHSIG after a thread of a live launcher exited
        return
    if not _gone_lock.acquire(blocking=False):
        return                      # the signal handler and the watcher thread both saw it
    print(f"tsp-train: the launcher (pid {launcher}) is gone; stopping", file=sys.stderr, flush=True)
    on_gone()
    os._exit(1)
