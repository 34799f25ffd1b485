"""run_on_ranks for the tests: the package's fork-based launcher (tsp_trainer/tools/launch.py) with
test-sized limits: a 60 s collective timeout and 240 s for the whole run. `backend` may name a
process group serving one device type only, e.g. "cpu:gloo". A failure on any rank
raises RuntimeError("distributed run failed ...") carrying every failing rank's traceback."""

from __future__ import annotations

from tsp_trainer.tools.launch import run_on_ranks as _run_on_ranks


def run_on_ranks(fn, world_size: int, *args, timeout: float = 240, pg_timeout_s: float = 60,
                 backend: str = "gloo"):
    return _run_on_ranks(fn, world_size, *args, timeout=timeout, pg_timeout_s=pg_timeout_s,
                         backend=backend)
