"""Eval loss by position: the per-token losses of the eval batches, bucketed by the position of the
token that predicts (position t predicts token t + 1) into powers of two:

    [0], [1], [2, 3], [4, 7], ..., [2^k, seq_len - 1]      (edges 0, 1, 2, 4, ..., seq_len)

A model that uses its context has a loss that falls with position; one that does not use what lies
beyond some distance shows a flat tail from that bucket on. Every rank buckets the tokens it holds,
in its own layout (zigzag chunks under TSP and SP, all tokens under TP), by their positions (below);
the [2, buckets] sums are then added over the groups that split a replica's tokens and over dp
(one all-reduce each, through Comm), so every token of the global eval batch counts once.

The position is the one RoPE sees: with document masking and `data.reset_positions` the position
inside the token's document (the positions carry the documents: `PositionRuns.documents`), else
the position inside the packed row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tsp_trainer.model.documents import rope_positions
from tsp_trainer.model.rope import PositionRuns
from tsp_trainer.model.transformer import IGNORE_INDEX, TokenStats
from tsp_trainer.parallel.comm import Comm


def bucket_edges(seq_len: int) -> list[int]:
    """[0, 1, 2, 4, ..., seq_len]: bucket i holds positions edges[i] .. edges[i + 1] - 1."""
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1 to bucket positions")
    edges = [0, 1]
    while edges[-1] * 2 < seq_len:
        edges.append(edges[-1] * 2)
    return edges + [seq_len] if edges[-1] < seq_len else edges


@dataclass(frozen=True)
class PositionLoss:
    """The reduced result: per bucket [start, end) the mean loss and the tokens it averages."""

    edges: tuple[int, ...]
    loss_sums: tuple[float, ...]
    tokens: tuple[float, ...]

    @property
    def mean_loss(self) -> float:
        """The eval loss: the mean over every valid token (all buckets together)."""
        return sum(self.loss_sums) / max(sum(self.tokens), 1.0)

    def rows(self) -> list[tuple[int, int, float | None, int]]:
        """(first position, last position, mean loss or None for an empty bucket, tokens)."""
        return [(self.edges[i], self.edges[i + 1] - 1, (s / n) if n else None, int(n))
                for i, (s, n) in enumerate(zip(self.loss_sums, self.tokens))]


class PositionLossAccumulator:
    """Sums of token losses and token counts per bucket on this rank (fp64, on the device)."""

    def __init__(self, seq_len: int, device: torch.device | str = "cpu"):
        self.edges = bucket_edges(seq_len)
        # bucketize's boundaries: inner edges; right=True puts position e into the bucket starting at e
        self._inner = torch.tensor(self.edges[1:-1], dtype=torch.long, device=device)
        self.sums = torch.zeros(2, len(self.edges) - 1, dtype=torch.float64, device=device)

    def add(self, stats: TokenStats, labels: torch.Tensor,
            positions: PositionRuns | torch.Tensor) -> None:
        """stats.loss, labels [B, T] in this rank's layout; positions: the layout's PositionRuns
        (host ints: checked without a device read), or a tensor [T] or [B, T] of positions.
        Runs that carry documents with reset_positions bucket each token by its position inside
        its document [B, T]; otherwise by its position in the row [T]."""
        if isinstance(positions, PositionRuns):
            last = max(first + n - 1 for first, n in positions.runs)   # bounds in-document ones too
            positions = _bucket_positions(positions, self._inner.device)
        else:
            last = int(positions.max())
        if last >= self.edges[-1]:
            raise ValueError(f"position {last} is beyond the buckets' seq_len {self.edges[-1]}")
        bucket = torch.bucketize(positions, self._inner, right=True).expand_as(labels).reshape(-1)
        valid = (labels != IGNORE_INDEX).reshape(-1)
        # weighted index_add (no boolean selection: no host sync on GPU)
        self.sums[0].index_add_(0, bucket, (stats.loss.reshape(-1) * valid).double())
        self.sums[1].index_add_(0, bucket, valid.double())

    def reduce(self, comms: list[Comm]) -> PositionLoss:
        """Sum over `comms` (the groups that split a replica's tokens, then dp); every rank gets
        the result. Collective: every rank of those groups calls it once per evaluation."""
        total = self.sums.clone()
        for comm in comms:
            comm.all_reduce(total, tag="eval.position_loss")
        sums, tokens = total.cpu().tolist()
        return PositionLoss(tuple(self.edges), tuple(sums), tuple(tokens))


def _bucket_positions(runs: PositionRuns, device) -> torch.Tensor:
    """The positions RoPE sees for these runs: [B, T] restarted per document under
    reset_positions, else the row positions [T]."""
    docs = runs.documents
    if docs is not None and docs.reset_positions:
        return rope_positions(runs.runs, docs, device=device)
    return runs.tensor(device)
