"""Zigzag sequence layout. A sequence of S tokens is cut into 2D chunks of C = S / (2D) tokens;
rank p holds chunks p and 2D-1-p, so causal attention work is balanced across ranks. Inputs, labels
(already shifted by one) and RoPE positions are laid out once, at the data boundary, and stay in
this layout through the whole network. Positions travel as PositionRuns (two runs of host ints per
rank), so nothing downstream reads them back from the device.

Gathered tensors (all_gather over the tsp group) arrive rank-major: [D, B, 2C, ...] = chunks
(c_0, c_{2D-1}), (c_1, c_{2D-2}), ...; `gathered_to_logical` puts them in order c_0 .. c_{2D-1}.
"""

from __future__ import annotations

import torch

from tsp_trainer.model.layers import PositionRuns


def chunk_ids(rank: int, degree: int) -> tuple[int, int]:
    return rank, 2 * degree - 1 - rank


def check_zigzag(seq_len: int, degree: int) -> None:
    if seq_len % (2 * degree):
        raise ValueError(f"data.seq_len={seq_len} must be divisible by 2 * parallel.tsp_degree = "
                         f"{2 * degree} (zigzag layout: 2D equal chunks)")


def zigzag_runs(seq_len: int, rank: int, degree: int) -> PositionRuns:
    """Global positions of the tokens rank `rank` holds, as two runs (host ints, no tensor)."""
    check_zigzag(seq_len, degree)
    c = seq_len // (2 * degree)
    return PositionRuns(tuple((chunk * c, c) for chunk in chunk_ids(rank, degree)))


def zigzag_positions(seq_len: int, rank: int, degree: int, device=None) -> torch.Tensor:
    """Global positions [S / D] of the tokens rank `rank` holds."""
    return zigzag_runs(seq_len, rank, degree).tensor(device)


def shard_sequence(x: torch.Tensor, rank: int, degree: int, dim: int = 1) -> torch.Tensor:
    """Take this rank's two chunks of x along `dim` (size S) -> size S / D."""
    check_zigzag(x.shape[dim], degree)
    chunks = x.chunk(2 * degree, dim=dim)
    a, b = chunk_ids(rank, degree)
    return torch.cat([chunks[a], chunks[b]], dim=dim)


def unshard_sequence(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of shard_sequence: parts[p] is rank p's [.., S/D, ..] slice -> full [.., S, ..]."""
    degree = len(parts)
    halves = [p.chunk(2, dim=dim) for p in parts]
    ordered = [halves[c][0] if c < degree else halves[2 * degree - 1 - c][1] for c in range(2 * degree)]
    return torch.cat(ordered, dim=dim)


def gathered_to_logical(g: torch.Tensor) -> torch.Tensor:
    """[D, B, 2C, *rest] rank-major -> [B, 2DC, *rest] in logical (position) order.

    Rank p's first half is chunk p and its second half chunk 2D-1-p: the first halves in rank
    order, then the second halves in reverse rank order, stacked from views in one copy (no index
    tensor, so nothing is copied from the host)."""
    degree, b, two_c = g.shape[:3]
    halves = g.reshape(degree, b, 2, two_c // 2, *g.shape[3:])           # [D, B, 2, C, ...] view
    pieces = [halves[p, :, 0] for p in range(degree)] + [halves[p, :, 1] for p in reversed(range(degree))]
    return torch.stack(pieces, dim=1).reshape(b, degree * two_c, *g.shape[3:])


def logical_to_gathered(x: torch.Tensor, degree: int) -> torch.Tensor:
    """Inverse of gathered_to_logical: [B, S, *rest] -> [D, B, S/D, *rest] rank-major (contiguous,
    one copy: rank p's block is chunks p and 2D-1-p)."""
    return _to_gathered((x,), degree)[:, :, :, 0]


def pair_to_gathered(k: torch.Tensor, v: torch.Tensor, degree: int) -> torch.Tensor:
    """logical_to_gathered of torch.stack((k, v), dim=2) without the stacked copy: k, v [B, S, *rest]
    (any strides, e.g. attention gradients) -> [D, B, S/D, 2, *rest] rank-major, contiguous."""
    return _to_gathered((k, v), degree)


def _to_gathered(parts: tuple[torch.Tensor, ...], degree: int) -> torch.Tensor:
    """[B, S, *rest] each -> [D, B, S/D, len(parts), *rest] rank-major, one copy per chunk and part."""
    x = parts[0]
    b, s = x.shape[:2]
    c = s // (2 * degree)
    out = x.new_empty((degree, b, 2, c, len(parts), *x.shape[2:]))
    for j, part in enumerate(parts):
        chunks = part.reshape(b, 2 * degree, c, *x.shape[2:])                # [B, 2D, C, ...]
        for p in range(degree):
            first, second = chunk_ids(p, degree)
            out[p, :, 0, :, j].copy_(chunks[:, first])
            out[p, :, 1, :, j].copy_(chunks[:, second])
    return out.view(degree, b, 2 * c, len(parts), *x.shape[2:])


def shard_batch(input_ids: torch.Tensor, labels: torch.Tensor, rank: int, degree: int):
    """This rank's zigzag slice of a batch [B, S] whose labels are already shifted (labels[t] is
    the token after input_ids[t]): (input_ids [B, S/D], labels [B, S/D], positions as
    PositionRuns: the two chunks, host ints)."""
    seq_len = input_ids.shape[1]
    return (shard_sequence(input_ids, rank, degree), shard_sequence(labels, rank, degree),
            zigzag_runs(seq_len, rank, degree))
