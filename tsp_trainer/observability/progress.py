"""Training progress bar with ETA (tqdm) on global rank 0. Off on other ranks, off when the stream is
not a terminal (CI logs, files) unless forced, and never reads stdin, so it works with stdin closed.

    with ProgressBar(total=cfg.train.steps, initial=start_step, rank=global_rank) as bar:
        for step in ...:
            bar.update(loss=loss, tokens_per_s=tps)

While the bar is shown, console log lines of the "tsp_trainer" logger are routed through
tqdm.write so they print above the bar instead of breaking it.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import IO

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from tsp_trainer.observability.log import PACKAGE_LOGGER


def _is_tty(stream: IO[str] | None) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):   # no isatty, or a closed stream
        return False


def format_postfix(*, loss: float | None = None, tokens_per_s: float | None = None) -> str:
    parts = []
    if loss is not None:
        parts.append(f"loss {float(loss):.4f}")
    if tokens_per_s is not None:
        parts.append(f"{float(tokens_per_s) / 1e3:.2f}k tok/s")
    return ", ".join(parts)


class ProgressBar:
    """Optimizer steps done out of `total`, with rate, ETA, loss and tok/s.

    Args:
        initial: steps already done (after a resume), so the ETA covers only what is left.
        rank: global rank; the bar exists on rank 0 only.
        enabled: None = on when `stream` is a TTY; True = on even when it is not (tests, `tee`);
            False = off. A disabled bar accepts every call and writes nothing.
        stream: where the bar is drawn (default sys.stderr).
    """

    def __init__(self, total: int, *, initial: int = 0, rank: int = 0, enabled: bool | None = None,
                 stream: IO[str] | None = None, desc: str = "train"):
        stream = stream if stream is not None else sys.stderr
        show = enabled if enabled is not None else _is_tty(stream)
        self.enabled = bool(show) and rank == 0 and stream is not None
        self._bar: tqdm | None = None
        self._redirect: contextlib.ExitStack | None = None
        if self.enabled:
            self._bar = tqdm(total=total, initial=initial, desc=desc, unit="step", file=stream,
                             dynamic_ncols=True, leave=True)

    def update(self, n: int = 1, *, loss: float | None = None, tokens_per_s: float | None = None) -> None:
        if self._bar is None:
            return
        postfix = format_postfix(loss=loss, tokens_per_s=tokens_per_s)
        if postfix:
            self._bar.set_postfix_str(postfix, refresh=False)
        self._bar.update(n)

    def close(self) -> None:
        if self._redirect is not None:
            self._redirect.close()
            self._redirect = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "ProgressBar":
        package = logging.getLogger(PACKAGE_LOGGER)
        # Redirect only an existing console handler: logging_redirect_tqdm would otherwise add one.
        console = [h for h in package.handlers if isinstance(h, logging.StreamHandler)
                   and getattr(h, "stream", None) in (sys.stdout, sys.stderr)]
        if self._bar is not None and console:
            self._redirect = contextlib.ExitStack()
            self._redirect.enter_context(logging_redirect_tqdm(loggers=[package]))
        return self

    def __exit__(self, *exc) -> None:
        self.close()
