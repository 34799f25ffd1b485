"""Upsampling of long documents (a long-context control): documents of at least `min_tokens`
tokens are trained on `factor` times on average, so a 128K window more often holds one long
coherent text instead of many short ones.

Each extra copy re-enters the stream `gap_docs` documents later (never right after its original,
where the model could copy it from its own context). A fractional factor gives each long document
floor(factor - 1) extra copies, plus one with probability frac(factor - 1), drawn from a hash of
(seed, dp_rank, document index) so a resume repeats it. The copies waiting to re-enter are part of
the state (their token ids: at most about (factor - 1) x gap_docs documents). Imports nothing of
ours but the mixture's draw.
"""

from __future__ import annotations

import bisect
import math
from typing import Any, Mapping

from tsp_trainer.data.mixture import uniform_draw


class LongDocUpsampler:
    """Wraps a document source (`next_document()`, `state_dict()`, ...) and repeats long ones."""

    def __init__(self, inner, *, min_tokens: int, factor: float, gap_docs: int, seed: int,
                 dp_rank: int):
        if min_tokens < 1 or factor < 1 or gap_docs < 1:
            raise ValueError(f"long-document upsampling needs min_tokens >= 1, factor >= 1 and "
                             f"gap_docs >= 1, got {min_tokens}, {factor}, {gap_docs}")
        self.inner = inner
        self.min_tokens, self.factor, self.gap_docs = min_tokens, factor, gap_docs
        self._seed, self._dp_rank = seed, dp_rank
        self.count = 0                                   # documents handed out (copies included)
        self._pending: list[tuple[int, int, list[int]]] = []   # (due index, order, ids), sorted
        self._order = 0
        self.long_docs = 0
        self.copies = 0

    def _extra_copies(self) -> int:
        extra = self.factor - 1
        whole = math.floor(extra)
        return whole + (uniform_draw(self._seed, self._dp_rank, self.count, "upsample") < extra - whole)

    def next_document(self, want_tokens: int | None = None) -> list[int]:
        if self._pending and self._pending[0][0] <= self.count:
            ids = self._pending.pop(0)[2]
            self.copies += 1
        else:
            ids = self.inner.next_document(want_tokens)
            if len(ids) >= self.min_tokens:
                self.long_docs += 1
                for j in range(self._extra_copies()):
                    bisect.insort(self._pending, (self.count + self.gap_docs * (j + 1), self._order, ids))
                    self._order += 1
        self.count += 1
        return ids

    @property
    def epoch(self) -> int:
        return self.inner.epoch

    def stats(self) -> dict[str, Any]:
        return {**self.inner.stats(), "long_docs": self.long_docs, "long_doc_copies": self.copies}

    def rewind(self) -> None:
        self.inner.rewind()
        self.count = self._order = self.long_docs = self.copies = 0
        self._pending = []

    def close(self) -> None:
        self.inner.close()

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "upsample", "inner": self.inner.state_dict(), "count": self.count,
                "order": self._order, "pending": [[d, o, list(ids)] for d, o, ids in self._pending],
                "long_docs": self.long_docs, "copies": self.copies,
                "settings": [self.min_tokens, self.factor, self.gap_docs]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("kind") != "upsample":
            raise ValueError("loader state was saved without long-document upsampling; an exact "
                             "resume needs the same data.upsample settings")
        if list(state["settings"]) != [self.min_tokens, self.factor, self.gap_docs]:
            raise ValueError(f"loader state has data.upsample (min_tokens, factor, gap_docs)="
                             f"{tuple(state['settings'])} but this run has "
                             f"{(self.min_tokens, self.factor, self.gap_docs)}")
        self.inner.load_state_dict(state["inner"])
        self.count, self._order = int(state["count"]), int(state["order"])
        self._pending = [(int(d), int(o), list(ids)) for d, o, ids in state["pending"]]
        self.long_docs, self.copies = int(state["long_docs"]), int(state["copies"])
