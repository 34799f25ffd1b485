"""Thin wrappers over torch.distributed: one `Comm` per process group (one mesh axis on this
rank). Every op takes ranks *within the group*, records itself in the ledger, and is a local no-op
on a group of size 1. This is the only module in the package that calls torch.distributed ops."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tsp_trainer.parallel.ledger import CommLedger


class _Done:
    """Stand-in for a completed Work handle (size-1 groups)."""

    def wait(self) -> bool:
        return True


class Comm:
    """A process group seen from one rank: its global ranks, this rank's index, and a ledger."""

    def __init__(self, group, ranks: list[int], rank: int, ledger: CommLedger, axis: str):
        self.group = group
        self.ranks = list(ranks)      # global rank of each group member, in group order
        self.rank = rank              # this process's index in `ranks`
        self.size = len(ranks)
        self.ledger = ledger
        self.axis = axis

    def __repr__(self) -> str:
        return f"Comm(axis={self.axis!r}, rank={self.rank}, ranks={self.ranks})"

    def _record(self, op: str, tag: str, nbytes: int) -> None:
        self.ledger.record(op, axis=self.axis, tag=tag, group_size=self.size, nbytes=nbytes)

    # -- collectives ------------------------------------------------------------------------------
    def broadcast(self, tensor: torch.Tensor, src: int, *, tag: str, async_op: bool = False):
        if self.size == 1:
            return _Done() if async_op else None
        self._record("broadcast", tag, _nbytes(tensor))
        return dist.broadcast(tensor, src=self.ranks[src], group=self.group, async_op=async_op)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, *, tag: str, async_op: bool = False):
        """out: [D * inp.shape[0], ...] (rank-major concatenation)."""
        if self.size == 1:
            out.copy_(inp.reshape(out.shape))
            return _Done() if async_op else None
        self._record("all_gather", tag, _nbytes(out))
        return dist.all_gather_single(out, inp.contiguous(), group=self.group, async_op=async_op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, *, tag: str, async_op: bool = False):
        """Sum over the group of inp [D * out.shape[0], ...]; this rank keeps block `rank`."""
        if self.size == 1:
            out.copy_(inp.reshape(out.shape))
            return _Done() if async_op else None
        self._record("reduce_scatter", tag, _nbytes(inp))
        return dist.reduce_scatter_single(out, inp.contiguous(), op=dist.ReduceOp.SUM,
                                          group=self.group, async_op=async_op)

    def reduce(self, tensor: torch.Tensor, dst: int, *, tag: str, async_op: bool = False):
        """Sum into `tensor` on group rank `dst` (other ranks' buffers are left undefined)."""
        if self.size == 1:
            return _Done() if async_op else None
        self._record("reduce", tag, _nbytes(tensor))
        return dist.reduce(tensor, dst=self.ranks[dst], op=dist.ReduceOp.SUM, group=self.group,
                           async_op=async_op)

    def all_reduce(self, tensor: torch.Tensor, *, tag: str, op=dist.ReduceOp.SUM, async_op: bool = False):
        if self.size == 1:
            return _Done() if async_op else None
        self._record("all_reduce", tag, _nbytes(tensor))
        return dist.all_reduce(tensor, op=op, group=self.group, async_op=async_op)

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.group)

    def broadcast_object(self, obj, src: int = 0):
        """obj from group rank `src` (pickled; small control messages only)."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.ranks[src], group=self.group)
        return box[0]

    def all_gather_object(self, obj) -> list:
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    # -- point to point ---------------------------------------------------------------------------
    def exchange(self, send: torch.Tensor, recv: torch.Tensor, *, send_to: int, recv_from: int,
                 tag: str, p2p_tag: int = 0) -> list:
        """Post one isend and one irecv (batch_isend_irecv) to/from group ranks; returns works.
        `p2p_tag` keeps concurrent exchanges between the same pair apart (gloo matches by tag)."""
        if self.size == 1:
            recv.copy_(send)
            return []
        self._record("send", tag, _nbytes(send))
        self._record("recv", tag, _nbytes(recv))
        ops = [dist.P2POp(dist.isend, send, self.ranks[send_to], self.group, p2p_tag),
               dist.P2POp(dist.irecv, recv, self.ranks[recv_from], self.group, p2p_tag)]
        return dist.batch_isend_irecv(ops)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def wait_all(works) -> None:
    for w in works:
        w.wait()
