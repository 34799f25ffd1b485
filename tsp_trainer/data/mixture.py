"""Mixtures weighted by tokens: `data.sources` with weights that are shares of the trained tokens.

Drawing documents with probability proportional to the weights (what `interleave_datasets` does)
gives shares of documents, not tokens: a 70/30 mix by documents of short and long documents came
out 98/2 by tokens. Here document d comes from source i with probability

    p_i = (w_i / L_i) / sum_j (w_j / L_j)      w: token share, L: mean tokens per document

so the expected tokens from source i are proportional to p_i L_i = w_i. L_i (with the BOS/EOS
the packer adds) is estimated once from the first `estimate_docs` documents of this rank's stream
of each source, logged, and saved in the loader state, so a resume draws exactly as before. Each
draw is a hash of (seed, dp_rank, draw index): the state is one counter. Imports numpy only.
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping, Sequence

import numpy as np

from tsp_trainer.data.documents import TokenDocuments


def uniform_draw(seed: int, dp_rank: int, index: int, salt: str = "mix") -> float:
    """A number in [0, 1) that depends only on its arguments (stable across processes)."""
    digest = hashlib.blake2b(f"{salt}:{seed}:{dp_rank}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0 ** 64


class MixtureDocuments:
    """Documents from several TokenDocuments sources, each getting its share of tokens."""

    def __init__(self, sources: Sequence[TokenDocuments], weights: Sequence[float], *,
                 seed: int, dp_rank: int, estimate_docs: int = 64, specials_per_doc: int = 1):
        if len(sources) != len(weights) or not sources:
            raise ValueError(f"a mixture needs one weight per source, got {len(sources)} sources "
                             f"and {len(weights)} weights")
        if any(not w > 0 for w in weights):
            raise ValueError(f"mixture weights must be > 0, got {list(weights)}")
        self.sources = list(sources)
        self.names = [s.name for s in self.sources]
        total = float(sum(weights))
        self.weights = [w / total for w in weights]
        self._seed, self._dp_rank = seed, dp_rank
        self._estimate_docs, self._specials = estimate_docs, specials_per_doc
        self.mean_tokens: list[float] | None = None     # estimated L_i, set on first use
        self.draws = 0

    # -- the draw -------------------------------------------------------------------------------
    def _ensure_estimates(self) -> None:
        if self.mean_tokens is None:
            self.mean_tokens = [self._estimate(s) for s in self.sources]

    def _estimate(self, source: TokenDocuments) -> float:
        """Mean tokens per document (with BOS/EOS; empty documents count as 0) of the first
        documents of `source`, which is then put back where it was."""
        saved = source.state_dict()
        lengths = [len(ids) + self._specials if ids else 0
                   for ids in (source.next_document() for _ in range(self._estimate_docs))]
        source.load_state_dict(saved)
        mean = float(np.mean(lengths))
        if mean <= 0:
            raise ValueError(f"mixture source {source.name!r}: its first {self._estimate_docs} "
                             "documents are all empty; cannot estimate its document length")
        return mean

    @property
    def probabilities(self) -> list[float]:
        self._ensure_estimates()
        raw = [w / length for w, length in zip(self.weights, self.mean_tokens)]
        return [r / sum(raw) for r in raw]

    def _pick(self) -> int:
        u = uniform_draw(self._seed, self._dp_rank, self.draws)
        return min(int(np.searchsorted(np.cumsum(self.probabilities), u, side="right")),
                   len(self.sources) - 1)

    def next_document(self, want_tokens: int | None = None) -> list[int]:
        i = self._pick()
        self.draws += 1
        return self.sources[i].next_document(want_tokens)

    # -- reporting ------------------------------------------------------------------------------
    def describe(self) -> str:
        """One line for the log: per source its token share, estimated length and draw odds."""
        parts = [f"{name!r} {w:.1%} of tokens, ~{length:,.0f} tokens/doc (first "
                 f"{self._estimate_docs} docs), p(doc)={p:.3f}"
                 for name, w, length, p in zip(self.names, self.weights, self.mean_tokens or [],
                                               self.probabilities)]
        return "mixture by tokens: " + "; ".join(parts)

    @property
    def epoch(self) -> int:
        """Passes of the most repeated source."""
        return max(s.epoch for s in self.sources)

    def stats(self) -> dict[str, Any]:
        per = [s.stats() for s in self.sources]
        total_tokens = sum(p["tokens"] + self._specials * p["docs"] for p in per) or 1
        out: dict[str, Any] = {
            "epoch": self.epoch, "docs": sum(p["docs"] for p in per),
            "tokens": sum(p["tokens"] for p in per),
            "docs_empty": sum(p["docs_empty"] for p in per),
            "docs_repaired": sum(p["docs_repaired"] for p in per)}
        for name, p in zip(self.names, per):
            out[f"epoch/{name}"] = p["epoch"]
            out[f"token_share/{name}"] = (p["tokens"] + self._specials * p["docs"]) / total_tokens
        return out

    # -- state ----------------------------------------------------------------------------------
    def rewind(self) -> None:
        for s in self.sources:
            s.rewind()
        self.draws = 0

    def close(self) -> None:
        for s in self.sources:
            s.close()

    def state_dict(self) -> dict[str, Any]:
        self._ensure_estimates()
        return {"kind": "mixture", "names": self.names, "weights": self.weights,
                "mean_tokens": list(self.mean_tokens), "draws": self.draws,
                "sources": [s.state_dict() for s in self.sources]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("kind") != "mixture" or list(state["names"]) != self.names:
            raise ValueError(f"loader state holds sources {state.get('names')} but this mixture has "
                             f"{self.names}; an exact resume needs the same data.sources")
        if not np.allclose(state["weights"], self.weights):
            raise ValueError(f"loader state has mixture weights {state['weights']} but this run "
                             f"{self.weights}; an exact resume needs the same data.sources weights")
        for s, st in zip(self.sources, state["sources"]):
            s.load_state_dict(st)
        self.mean_tokens = [float(x) for x in state["mean_tokens"]]
        self.draws = int(state["draws"])
