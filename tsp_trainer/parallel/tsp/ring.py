"""The two weight-moving schedules of TSP, written once and used by the MLP, embedding and LM head.

`ring_forward`: every rank starts with its own packed shard; at step k rank p holds shard
(p - k) mod D, computes with it, and passes it on to p + 1 (batch_isend_irecv posted *before* the
compute, so the transfer overlaps it). After D steps every rank has seen every shard.

`ring_backward`: the reverse ring. At step k rank p holds shard (p + k) mod D and adds its local
gradient for that shard to the accumulator that arrived with it from p + 1, then sends both on to
p - 1. The accumulator has the dtype `grad_step` returns: the blocks return fp32, so the sum over
the D ranks is never rounded to bf16 (accumulator hops move 4 bytes per element). Shard j's accumulator visits j, j-1, ..., j+1 and a last hop brings it home to j, so the
full gradient (summed over all D ranks' tokens) ends at its owner and no rank ever holds more than
two shards and two accumulators. Traffic per rank: D - 1 weight hops and D accumulator hops
(accumulator hops only, when the gradient does not need the weights: the embedding).

`broadcast_shards`: the attention schedule: owner r broadcasts its shard, one owner at a time,
with shard r + 1 prefetched asynchronously while shard r is used.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from tsp_trainer.parallel.comm import Comm, wait_all

_WEIGHT_TAG, _GRAD_TAG = 0, 1   # P2P tags: keep weight and accumulator messages apart


def ring_forward(comm: Comm, own: torch.Tensor, step: Callable[[int, torch.Tensor], None], *,
                 tag: str) -> None:
    """Call step(j, shard_j) for every shard j, passing the packed shards around the ring.
    `own` must be a packed copy (it is reused as a receive buffer)."""
    d, p = comm.size, comm.rank
    cur, nxt = own, (torch.empty_like(own) if d > 1 else None)
    for k in range(d):
        works = []
        if k < d - 1:
            works = comm.exchange(cur, nxt, send_to=(p + 1) % d, recv_from=(p - 1) % d, tag=tag,
                                  p2p_tag=_WEIGHT_TAG)
        step((p - k) % d, cur)
        wait_all(works)
        if k < d - 1:
            cur, nxt = nxt, cur


def ring_backward(comm: Comm, own: torch.Tensor | None,
                  grad_step: Callable[[int, torch.Tensor | None], torch.Tensor], *,
                  tag: str) -> torch.Tensor:
    """Reverse ring carrying gradient accumulators home. grad_step(j, shard_j) returns this rank's
    packed partial gradient for shard j. Returns the full gradient of this rank's own shard.
    own=None: the gradient does not need the weights (embedding), only accumulators travel."""
    d, p = comm.size, comm.rank
    cur = own
    nxt = torch.empty_like(own) if (d > 1 and own is not None) else None
    acc_works, acc_in = [], None
    for k in range(d):
        w_works = []
        if k < d - 1 and own is not None:
            w_works = comm.exchange(cur, nxt, send_to=(p - 1) % d, recv_from=(p + 1) % d, tag=tag,
                                    p2p_tag=_WEIGHT_TAG)
        local = grad_step((p + k) % d, cur)
        wait_all(acc_works)                       # accumulator for shard p+k, sent by p+1 at k-1
        acc = local if acc_in is None else acc_in.add_(local)
        if d == 1:
            return acc
        acc_in = torch.empty_like(acc)
        acc_works = comm.exchange(acc, acc_in, send_to=(p - 1) % d, recv_from=(p + 1) % d,
                                  tag=tag + ".grad", p2p_tag=_GRAD_TAG)
        wait_all(w_works)
        if k < d - 1 and own is not None:
            cur, nxt = nxt, cur
    wait_all(acc_works)
    return acc_in                                  # shard p's accumulator, home after D hops


def broadcast_shards(comm: Comm, own: torch.Tensor, *, tag: str) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (r, shard_r) for r = 0..D-1: owner r broadcasts its packed shard; shard r+1 is
    prefetched into the second buffer while the caller computes with shard r. Every rank issues the
    broadcasts in the same order (0, 1, ..., D-1), interleaved identically with the caller's ops."""
    d = comm.size
    bufs = [torch.empty_like(own), torch.empty_like(own)] if d > 1 else []

    def start(r: int):
        buf = own if r == comm.rank else bufs[r % 2]
        return buf, comm.broadcast(buf, src=r, tag=tag, async_op=True)

    pending = start(0)
    for r in range(d):
        buf, work = pending
        work.wait()
        if r + 1 < d:
            pending = start(r + 1)
        yield r, buf


def pack(*tensors: torch.Tensor) -> torch.Tensor:
    """One contiguous 1-D copy of the tensors (the unit a broadcast or ring hop moves)."""
    return torch.cat([t.reshape(-1) for t in tensors])


def unpack(flat: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """Views of `flat` with the given shapes (inverse of pack)."""
    out, offset = [], 0
    for shape in shapes:
        n = 1
        for s in shape:
            n *= s
        out.append(flat[offset:offset + n].view(shape))
        offset += n
    return out
