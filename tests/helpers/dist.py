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


def _run_cases(rank, world, cases):
    """Each case's fn(rank, world, *args) in turn, in this fork's one process group."""
    results = []
    for label, fn, args in cases:
        try:
            results.append(fn(rank, world, *args))
        except BaseException as exc:
            raise RuntimeError(f"case {label!r} failed on rank {rank}") from exc
    return results


class ForkedCases:
    """The distributed cases of one test module, run several to a fork. Each case is registered at
    import (`add(world, key, fn, *args)`, in test order); the first test to read a case
    (`result(world, key)`) runs it and the next registered cases of that world size, up to
    `per_fork`, in one run_on_ranks, and keeps their per-rank results for the tests that follow.
    A process group starts once per chunk instead of once per case (the start and each rank's first
    collectives cost ~1-2 s under load, more than a tiny model's step); each case stays its own test
    with its own assertions. A failed chunk fails each of its tests with the same error, without a
    second fork."""

    def __init__(self, per_fork: int = 8):
        self.per_fork = per_fork
        self._cases: dict[int, dict] = {}
        self._done: dict[tuple, object] = {}

    def add(self, world: int, key, fn, *args):
        self._cases.setdefault(world, {})[key] = (fn, args)
        return key

    def result(self, world: int, key) -> list:
        if (world, key) not in self._done:
            pending = [k for k in self._cases[world] if (world, k) not in self._done]
            chunk = pending[pending.index(key):][:self.per_fork]
            try:
                outs = run_on_ranks(_run_cases, world,
                                    [(k, *self._cases[world][k]) for k in chunk])
                for i, k in enumerate(chunk):
                    self._done[(world, k)] = [out[i] for out in outs]
            except RuntimeError as exc:
                for k in chunk:
                    self._done[(world, k)] = exc
        done = self._done[(world, key)]
        if isinstance(done, RuntimeError):
            raise done
        return done
