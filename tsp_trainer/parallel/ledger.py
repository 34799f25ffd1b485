"""Communication ledger: every collective and P2P op issued by `tsp_trainer.parallel` is recorded
here with its kind, axis, group size, tag and payload bytes, so tests and benchmarks can read bytes
per rank per step and compare them with the closed-form formulas in docs/parallelism.md.

Payload bytes are the size of the tensor the op works on, on this rank:
  broadcast          the broadcast buffer (on the source and on every receiver)
  all_gather         the gathered output (D x the local input)
  reduce_scatter     the full input (D x the local output)
  reduce, all_reduce the reduced buffer
  send, recv         the tensor sent or received (P2P; recorded separately)

`blocked_s` adds up the host time this rank spent blocked in the ops (a synchronous call, or the
wait() of an async one): waiting for slower peers plus the transfer. Step time minus it is the
rank's own time, which names the rank the others wait for (observability's rank stats).
"""

from __future__ import annotations

import collections
import itertools
import time
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class CommRecord:
    op: str           # broadcast | all_gather | reduce_scatter | reduce | all_reduce | send | recv
    axis: str         # mesh axis of the group: "tsp", "dp", "world", ...
    tag: str          # what moved, e.g. "attn.weights", "attn.kv", "mlp.ring"
    group_size: int
    nbytes: int
    dtype: str = ""   # element type of the payload, e.g. "float32" ("" for control messages)


class InFlight:
    """The ops issued and not yet completed on this rank, for the hang watchdog (run/watchdog.py):
    begin() when an op is issued, end() when it returns or its Work is waited. Entries hold a
    description callable (built only when a dump asks) and the time the op started.

    Touched from the training thread only; the watchdog thread reads a snapshot (dict copies are
    atomic under the GIL)."""

    def __init__(self):
        self._ops: dict[int, tuple[float, Callable[[], str]]] = {}
        self._ids = itertools.count()

    def begin(self, describe: Callable[[], str]) -> int:
        token = next(self._ids)
        self._ops[token] = (time.monotonic(), describe)
        return token

    def end(self, token: int) -> None:
        self._ops.pop(token, None)

    def describe(self) -> list[str]:
        """One line per op in flight, oldest first, with how long it has been waiting."""
        now = time.monotonic()
        return [f"{describe()} (in flight for {now - started:.1f} s)"
                for started, describe in sorted(dict(self._ops).values(), key=lambda e: e[0])]


class CommLedger:
    """An append-only list of CommRecord with group-by helpers. Disabled ledgers record nothing.
    `in_flight` tracks the ops not yet completed (always on: a hang dump needs it most when the
    byte accounting is off)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.records: list[CommRecord] = []
        self.in_flight = InFlight()
        self.blocked_s = 0.0          # host seconds blocked in ops since the last reset()

    def record(self, op: str, *, axis: str, tag: str, group_size: int, nbytes: int,
               dtype: str = "") -> None:
        if self.enabled:
            self.records.append(CommRecord(op, axis, tag, group_size, int(nbytes), dtype))

    def dtypes_by_tag(self) -> dict[str, set[str]]:
        """tag -> element types its payloads had (tests assert e.g. fp32 gradient reductions)."""
        out: dict[str, set[str]] = collections.defaultdict(set)
        for r in self.records:
            out[r.tag].add(r.dtype)
        return dict(out)

    def add_blocked(self, seconds: float) -> None:
        self.blocked_s += seconds

    def reset(self) -> None:
        self.records.clear()
        self.blocked_s = 0.0

    def total_bytes(self, **match) -> int:
        return sum(r.nbytes for r in self._select(match))

    def count(self, **match) -> int:
        return sum(1 for _ in self._select(match))

    def bytes_by(self, *keys: str, **match) -> dict:
        """Sum of payload bytes grouped by record fields, e.g. bytes_by("op", "tag")."""
        out: dict = collections.defaultdict(int)
        for r in self._select(match):
            key = tuple(getattr(r, k) for k in keys)
            out[key[0] if len(key) == 1 else key] += r.nbytes
        return dict(out)

    def summary(self) -> dict[str, dict[str, int]]:
        """{"op/tag": {"count": n, "bytes": b}}: the JSON-friendly form benchmarks write out."""
        out: dict[str, dict[str, int]] = {}
        for r in self.records:
            entry = out.setdefault(f"{r.op}/{r.tag}", {"count": 0, "bytes": 0})
            entry["count"] += 1
            entry["bytes"] += r.nbytes
        return out

    def _select(self, match: dict):
        return (r for r in self.records if all(getattr(r, k) == v for k, v in match.items()))
