"""The weight-moving schedules of TSP, written once: the rings of the MLP, embedding and LM head
(`ring_forward`, `ring_backward`, `ring_backward_into`, their hops posted through `RingComm`) and the
attention's owner-by-owner broadcasts (`ShardBroadcasts`). Why each rank holds at most two shards
and two accumulators, and what moves per hop: docs/parallelism.md, "TSP rings".
"""

from __future__ import annotations

from typing import Callable

import torch

from tsp_trainer.parallel.comm import Comm, P2PTag, wait_all


class RingComm:
    """One ring of `comm` seen from this rank: every hop sends to the neighbour on one side and
    receives from the neighbour on the other (`step=+1`: send to p + 1, receive from p - 1;
    `step=-1`: the reverse ring). `send_recv` queues a hop, `commit` posts the queued hops (each
    recorded in the ledger as a send and a recv under `tag`), `wait` blocks until they are done.
    One RingComm per stream of hops that is waited for on its own (weights, accumulators)."""

    def __init__(self, comm: Comm, *, step: int, tag: str, p2p_tag: P2PTag):
        self.comm, self.tag, self.p2p_tag = comm, tag, p2p_tag
        self.send_to, self.recv_from = (comm.rank + step) % comm.size, (comm.rank - step) % comm.size
        self._queued: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._works: list = []

    def send_recv(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        self._queued.append((send, recv))

    def commit(self) -> None:
        for send, recv in self._queued:
            self._works += self.comm.exchange(send, recv, send_to=self.send_to, recv_from=self.recv_from,
                                              tag=self.tag, p2p_tag=self.p2p_tag)
        self._queued = []

    def wait(self) -> None:
        wait_all(self._works)
        self._works = []


def ring_forward(comm: Comm, own: torch.Tensor, step: Callable[[int, torch.Tensor], None], *,
                 tag: str) -> None:
    """Call step(j, shard_j) for every shard j, passing the packed shards around the ring.
    `own` must be a packed copy (it is reused as a receive buffer)."""
    d, p = comm.size, comm.rank
    weights = RingComm(comm, step=+1, tag=tag, p2p_tag=P2PTag.RING_WEIGHTS)
    cur, nxt = own, (torch.empty_like(own) if d > 1 else None)
    for k in range(d):
        if k < d - 1:                              # the next shard travels under this step
            weights.send_recv(cur, nxt)
            weights.commit()
        step((p - k) % d, cur)
        weights.wait()
        if k < d - 1:
            cur, nxt = nxt, cur


def ring_backward(comm: Comm, own: torch.Tensor | None,
                  grad_step: Callable[[int, torch.Tensor | None], torch.Tensor], *,
                  tag: str) -> torch.Tensor:
    """Reverse ring carrying gradient accumulators home. grad_step(j, shard_j) returns this rank's
    packed partial gradient for shard j. Returns the full gradient of this rank's own shard.
    own=None: the gradient does not need the weights (embedding), only accumulators travel."""
    d, p = comm.size, comm.rank
    weights = RingComm(comm, step=-1, tag=tag, p2p_tag=P2PTag.RING_WEIGHTS)
    grads = RingComm(comm, step=-1, tag=tag + ".grad", p2p_tag=P2PTag.RING_GRADS)
    cur = own
    nxt = torch.empty_like(own) if (d > 1 and own is not None) else None
    acc_in = None
    for k in range(d):
        if k < d - 1 and own is not None:
            weights.send_recv(cur, nxt)
            weights.commit()
        local = grad_step((p + k) % d, cur)
        grads.wait()                              # accumulator for shard p+k, sent by p+1 at k-1
        acc = local if acc_in is None else acc_in.add_(local)
        if d == 1:
            return acc
        acc_in = torch.empty_like(acc)
        grads.send_recv(acc, acc_in)
        grads.commit()
        weights.wait()
        if k < d - 1 and own is not None:
            cur, nxt = nxt, cur
    grads.wait()
    return acc_in                                  # shard p's accumulator, home after D hops


def ring_backward_into(comm: Comm, own: torch.Tensor,
                       grad_into: Callable[[int, torch.Tensor, torch.Tensor], None], *,
                       tag: str) -> torch.Tensor:
    """`ring_backward` with the partial gradients written straight into the travelling fp32
    accumulator: grad_into(j, shard_j, acc) adds this rank's gradient for shard j into `acc`
    (packed, fp32). Buffers are reused: the accumulator sent at one step becomes the receive
    buffer of the next, so a step holds 4 packed buffers: the shard in use, the one arriving, the
    accumulator being filled and the one arriving (tests/distributed/test_tsp_memory.py)."""
    d, p = comm.size, comm.rank
    weights = RingComm(comm, step=-1, tag=tag, p2p_tag=P2PTag.RING_WEIGHTS)
    grads = RingComm(comm, step=-1, tag=tag + ".grad", p2p_tag=P2PTag.RING_GRADS)
    cur, nxt = own, (torch.empty_like(own) if d > 1 else None)
    acc = torch.zeros(own.shape, dtype=torch.float32, device=own.device)
    spare = None
    for k in range(d):
        if k < d - 1:
            weights.send_recv(cur, nxt)
            weights.commit()
        grads.wait()                              # from k = 1: acc is shard p+k's, from p+1
        grad_into((p + k) % d, cur, acc)
        if d == 1:
            return acc
        recv = spare if spare is not None else torch.empty_like(acc)
        grads.send_recv(acc, recv)
        grads.commit()
        weights.wait()
        if k < d - 1:
            cur, nxt = nxt, cur
        acc, spare = recv, acc                    # the sent buffer is the next receive buffer
    grads.wait()
    return acc                                     # shard p's accumulator, home after D hops


class ShardBroadcasts:
    """The attention schedule: owner r broadcasts its packed shard, r = 0..D-1 in that order on
    every rank, into a pool of `buffers` rotating buffers. A broadcast is issued as soon as a
    buffer is free, so while the caller computes with shard r the next buffers - 1 shards are
    already on their way; `release(r)` hands r's buffer to the next broadcast. This rank's own
    shard is packed into a pool buffer when its turn comes: no standing packed copy, so the block
    holds exactly `buffers` shards of weights (tests/distributed/test_tsp_memory.py)."""

    def __init__(self, comm: Comm, params: list[torch.Tensor], *, buffers: int, tag: str):
        self.comm, self.params, self.tag = comm, params, tag
        numel = sum(p.numel() for p in params)
        self._free = [params[0].new_empty(numel) for _ in range(max(1, min(buffers, comm.size)))]
        self._issued: dict[int, list] = {}        # r -> [buffer, work or None once waited]
        self._next = 0
        self._issue()

    def _issue(self) -> None:
        while self._free and self._next < self.comm.size:
            r, buf = self._next, self._free.pop()
            self._next += 1
            if r == self.comm.rank:
                torch.cat([p.reshape(-1) for p in self.params], out=buf)
            self._issued[r] = [buf, self.comm.broadcast(buf, src=r, tag=self.tag, async_op=True)]

    def get(self, r: int) -> torch.Tensor:
        """Shard r (packed), waiting for its broadcast if it is still in flight."""
        entry = self._issued[r]
        if entry[1] is not None:
            entry[1].wait()
            entry[1] = None
        return entry[0]

    def release(self, r: int) -> None:
        """Shard r is no longer needed: its buffer takes the next owner's broadcast."""
        self.get(r)                      # a buffer is reused only after its broadcast completed
        self._free.append(self._issued.pop(r)[0])
        self._issue()


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

