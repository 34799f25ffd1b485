"""Thin wrappers over torch.distributed: one `Comm` per process group (one mesh axis on this
rank). Every op takes ranks *within the group*, records itself in the ledger, and is a local no-op
on a group of size 1. This is the only module in the package that calls torch.distributed ops.

Failures: a collective runs under the process group's timeout (train.collective_timeout_s). When a
peer dies or the timeout expires, the backend's error is re-raised as CommError naming the op, what
it moved, the axis, this rank and the peers involved, instead of a bare backend message (or, with
no timeout, a hang)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from tsp_trainer.parallel.ledger import CommLedger


class CommError(RuntimeError):
    """A collective or P2P op failed (peer gone, timeout, broken connection)."""


class _Done:
    """Stand-in for a completed Work handle (size-1 groups)."""

    def wait(self) -> bool:
        return True


class _Work:
    """An async Work whose wait() re-raises failures as CommError with the op's context."""

    def __init__(self, work, describe, ledger: CommLedger):
        self._work, self._describe, self._ledger = work, describe, ledger

    def wait(self) -> bool:
        start = time.perf_counter()
        try:
            return self._work.wait()
        except Exception as err:                 # gloo/NCCL raise RuntimeError subclasses
            raise CommError(f"{self._describe()} failed: {_first_line(err)}") from err
        finally:
            self._ledger.add_blocked(time.perf_counter() - start)


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

    def _run(self, op: str, tag: str, nbytes: int, call, *, peers=None, async_op: bool = False,
             role: str = ""):
        """Record the op, issue it, and attach context to any failure."""
        self.ledger.record(op, axis=self.axis, tag=tag, group_size=self.size, nbytes=nbytes)

        def describe() -> str:
            who = f"group global ranks {self.ranks}" if peers is None else f"peer global rank(s) {peers}"
            return (f"{op} of {tag!r} ({nbytes} bytes) on axis {self.axis!r}, rank "
                    f"{self.ranks[self.rank]} with {who}" + (f", {role}" if role else ""))
        start = time.perf_counter()
        try:
            result = call()
        except Exception as err:
            raise CommError(f"{describe()} failed: {_first_line(err)}") from err
        finally:
            self.ledger.add_blocked(time.perf_counter() - start)
        if async_op:
            return _Work(result, describe, self.ledger)
        return result

    # -- collectives ------------------------------------------------------------------------------
    def broadcast(self, tensor: torch.Tensor, src: int, *, tag: str, async_op: bool = False):
        if self.size == 1:
            return _Done() if async_op else None
        return self._run("broadcast", tag, _nbytes(tensor), lambda: dist.broadcast(
            tensor, src=self.ranks[src], group=self.group, async_op=async_op),
            async_op=async_op, role=f"source global rank {self.ranks[src]}")

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, *, tag: str, async_op: bool = False):
        """out: [D * inp.shape[0], ...] (rank-major concatenation)."""
        if self.size == 1:
            out.copy_(inp.reshape(out.shape))
            return _Done() if async_op else None
        return self._run("all_gather", tag, _nbytes(out), lambda: dist.all_gather_single(
            out, inp.contiguous(), group=self.group, async_op=async_op), async_op=async_op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, *, tag: str, async_op: bool = False):
        """Sum over the group of inp [D * out.shape[0], ...]; this rank keeps block `rank`."""
        if self.size == 1:
            out.copy_(inp.reshape(out.shape))
            return _Done() if async_op else None
        return self._run("reduce_scatter", tag, _nbytes(inp), lambda: dist.reduce_scatter_single(
            out, inp.contiguous(), op=dist.ReduceOp.SUM, group=self.group, async_op=async_op),
            async_op=async_op)

    def reduce(self, tensor: torch.Tensor, dst: int, *, tag: str, async_op: bool = False):
        """Sum into `tensor` on group rank `dst` (other ranks' buffers are left undefined)."""
        if self.size == 1:
            return _Done() if async_op else None
        return self._run("reduce", tag, _nbytes(tensor), lambda: dist.reduce(
            tensor, dst=self.ranks[dst], op=dist.ReduceOp.SUM, group=self.group, async_op=async_op),
            async_op=async_op, role=f"destination global rank {self.ranks[dst]}")

    def all_reduce(self, tensor: torch.Tensor, *, tag: str, op=dist.ReduceOp.SUM, async_op: bool = False):
        if self.size == 1:
            return _Done() if async_op else None
        return self._run("all_reduce", tag, _nbytes(tensor), lambda: dist.all_reduce(
            tensor, op=op, group=self.group, async_op=async_op), async_op=async_op)

    def barrier(self) -> None:
        if self.size > 1:
            self._run("barrier", "barrier", 0, lambda: dist.barrier(group=self.group))

    def broadcast_object(self, obj, src: int = 0):
        """obj from group rank `src` (pickled; small control messages only)."""
        if self.size == 1:
            return obj
        box = [obj]
        self._run("broadcast_object", "control", 0, lambda: dist.broadcast_object_list(
            box, src=self.ranks[src], group=self.group), role=f"source global rank {self.ranks[src]}")
        return box[0]

    def gather_object(self, obj, dst: int = 0) -> list | None:
        """Every rank's obj, in group order, on group rank `dst` (None elsewhere); pickled, for
        small control messages (e.g. the checkpoint files each rank wrote, with their sha256)."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size if self.rank == dst else None
        self._run("gather_object", "control", 0, lambda: dist.gather_object(
            obj, out, dst=self.ranks[dst], group=self.group), role=f"destination global rank {self.ranks[dst]}")
        return out

    def all_gather_object(self, obj) -> list:
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        self._run("all_gather_object", "control", 0,
                  lambda: dist.all_gather_object(out, obj, group=self.group))
        return out

    # -- point to point ---------------------------------------------------------------------------
    def exchange(self, send: torch.Tensor, recv: torch.Tensor, *, send_to: int, recv_from: int,
                 tag: str, p2p_tag: int = 0) -> list:
        """Post one isend and one irecv (batch_isend_irecv) to/from group ranks; returns works.
        `p2p_tag` keeps concurrent exchanges between the same pair apart (gloo matches by tag)."""
        if self.size == 1:
            recv.copy_(send)
            return []
        self.ledger.record("send", axis=self.axis, tag=tag, group_size=self.size, nbytes=_nbytes(send))
        dst, src = self.ranks[send_to], self.ranks[recv_from]
        ops = [dist.P2POp(dist.isend, send, dst, self.group, p2p_tag),
               dist.P2POp(dist.irecv, recv, src, self.group, p2p_tag)]
        works = self._run("recv", tag, _nbytes(recv), lambda: dist.batch_isend_irecv(ops),
                          peers=[dst, src])
        return [_Work(w, lambda: f"send/recv of {tag!r} on axis {self.axis!r}, rank "
                                 f"{self.ranks[self.rank]} sending to global rank {dst}, receiving "
                                 f"from global rank {src}", self.ledger) for w in works]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def wait_all(works) -> None:
    for w in works:
        w.wait()
