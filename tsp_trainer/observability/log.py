"""Rank-aware logging on top of the standard library. Imports no torch.distributed and never
synchronises ranks: the caller passes its rank (no dist.barrier, no process-group lookups).

    log = get_logger(__name__, rank=global_rank)
    log.info("step %d", step)        # printed on rank 0 only, as "[rank 0] step 12"
    log.warning("slow data")         # printed on every rank: warnings and errors are never dropped

`print` is left alone (no shadowing, unlike picotron).
"""

from __future__ import annotations

import logging
import sys
from typing import IO, Any, MutableMapping

PACKAGE_LOGGER = "tsp_trainer"
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_DATEFMT = "%H:%M:%S"


class _OurHandler(logging.StreamHandler):
    """Marks the handler configure_logging installed, so a second call replaces it."""


class RankLoggerAdapter(logging.LoggerAdapter):
    """Prefixes "[rank r]" and, with only_rank0, drops records below WARNING on ranks != 0."""

    def __init__(self, logger: logging.Logger, *, rank: int, only_rank0: bool):
        super().__init__(logger, {"rank": rank})
        self.rank = rank
        self.only_rank0 = only_rank0

    def isEnabledFor(self, level: int) -> bool:  # noqa: N802 (stdlib name)
        if self.only_rank0 and self.rank != 0 and level < logging.WARNING:
            return False
        return super().isEnabledFor(level)

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        # `rank` also goes into the record (extra) for structured handlers.
        kwargs["extra"] = {**self.extra, **kwargs.get("extra", {})}
        return f"[rank {self.rank}] {msg}", kwargs


def configure_logging(*, level: int | str = logging.INFO, stream: IO[str] | None = None) -> None:
    """Install one console handler on the "tsp_trainer" logger (idempotent: replaces our previous one).

    Records still propagate to the root logger, so pytest's caplog and user handlers see them; a user
    who configures the root logger with a console handler as well will see lines twice and can
    instead set `logging.getLogger("tsp_trainer").handlers = []`.
    """
    logger = logging.getLogger(PACKAGE_LOGGER)
    for handler in [h for h in logger.handlers if isinstance(h, _OurHandler)]:
        logger.removeHandler(handler)
    handler = _OurHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt=_DATEFMT))
    logger.addHandler(handler)
    logger.setLevel(level)


def get_logger(name: str, *, rank: int = 0, only_rank0: bool = True) -> RankLoggerAdapter:
    """A logger for `name` that knows this process's rank.

    Args:
        rank: the global rank of this process (the caller knows it; nothing is looked up here).
        only_rank0: drop DEBUG/INFO records on ranks != 0; WARNING and above always pass.

    The first call configures a console handler for "tsp_trainer.*" if neither that logger nor the
    root logger has handlers yet, so a script that never touches `logging` still sees INFO lines.
    """
    package = logging.getLogger(PACKAGE_LOGGER)
    if not package.handlers and not logging.getLogger().handlers:
        configure_logging()
    return RankLoggerAdapter(logging.getLogger(name), rank=rank, only_rank0=only_rank0)
