"""Thin wrappers over torch.distributed: one `Comm` per process group (one mesh axis on this
rank), the only module of the package that calls torch.distributed ops. Every op takes ranks
within the group, records itself in the ledger, and is a local no-op on a group of size 1.

Why wrap: a failed or timed-out op becomes a CommError naming the op, its bytes, the axis and the
peers (not a bare backend message); every op is marked in flight for the hang watchdog, also ops
another library issues on our groups (`foreign_ops`); and a tensor off the run's device is refused
by name before NCCL fails deep inside. On gloo, all-gather and reduce-scatter run as direct
point-to-point exchanges, cheaper than gloo's collectives for the same bytes
(docs/benchmarks.md, "Communication"); the ledger records them as the collectives they replace.
"""

from __future__ import annotations

import contextlib
import enum
import time

import torch
import torch.distributed as dist

from tsp_trainer.parallel.ledger import CommLedger


class CommError(RuntimeError):
    """A collective or P2P op failed (peer gone, timeout, broken connection). `ranks`: the global
    ranks of the op's group (or its peers), which the caller can map to nodes (run/placement.py)."""

    def __init__(self, message: str, ranks=()):
        super().__init__(message)
        self.ranks = tuple(ranks)


class WrongDeviceError(RuntimeError):
    """A tensor handed to a collective is not on the run's compute device (a programming error)."""


class _Done:
    """Stand-in for a completed Work handle (size-1 groups)."""

    def wait(self) -> bool:
        return True


class _Work:
    """An async Work whose wait() re-raises failures as CommError with the op's context, and takes
    the op out of the in-flight set once it completed (or failed)."""

    def __init__(self, work, describe, ledger: CommLedger, ranks=()):
        self._work, self._describe, self._ledger, self._ranks = work, describe, ledger, ranks
        self._token = ledger.in_flight.begin(describe)

    def wait(self) -> bool:
        start = time.perf_counter()
        try:
            return self._work.wait()
        except Exception as err:                 # gloo/NCCL raise RuntimeError subclasses
            raise CommError(f"{self._describe()} failed: {_first_line(err)}", self._ranks) from err
        finally:
            self._ledger.add_blocked(time.perf_counter() - start)
            self._ledger.in_flight.end(self._token)


class _DirectWork:
    """The P2P works of a direct all-gather / reduce-scatter; wait() waits for all of them, then
    runs `finish` (the local part of the op) once."""

    def __init__(self, works, finish=None):
        self._works, self._finish = works, finish

    def wait(self) -> bool:
        for w in self._works:
            w.wait()
        self._works = []
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True


class P2PTag(enum.IntEnum):
    """Every P2P tag of the package. gloo matches a receive to a send by (peer, tag), in the order
    posted: ops of one kind between a pair share a tag, kinds that may be in flight together get
    their own."""

    RING_WEIGHTS = 0        # tsp/ring.py: a weight shard's hop
    RING_GRADS = 1          # tsp/ring.py: a gradient accumulator's hop, beside a weight hop
    ALL_GATHER = 2          # direct all-gather on gloo (Comm._direct_all_gather)
    REDUCE_SCATTER = 3      # direct reduce-scatter on gloo (Comm._direct_reduce_scatter)


class Comm:
    """A process group seen from one rank: its global ranks, this rank's index, and a ledger."""

    def __init__(self, group, ranks: list[int], rank: int, ledger: CommLedger, axis: str, *,
                 device: torch.device | str = "cpu"):
        self.group = group
        self.ranks = list(ranks)      # global rank of each group member, in group order
        self.rank = rank              # this process's index in `ranks`
        self.size = len(ranks)
        self.ledger = ledger
        self.axis = axis
        self.device = torch.device(device)    # where every tensor of this group's ops must live
        # all-gather and reduce-scatter as direct exchanges on gloo (module docstring); all_reduce,
        # broadcast and reduce stay gloo's: a direct all-reduce is no cheaper, and a direct reduce
        # would hold D - 1 received gradient shards at the owner
        self.direct_exchanges = self.size > 1 and _backend(group) == "gloo"

    def __repr__(self) -> str:
        return f"Comm(axis={self.axis!r}, rank={self.rank}, ranks={self.ranks}, device={self.device})"

    def check_device(self, op: str, tag: str, *tensors: torch.Tensor) -> None:
        """Raise WrongDeviceError unless every tensor is on this run's compute device."""
        for i, t in enumerate(tensors):
            if not on_device(t, self.device):
                raise WrongDeviceError(
                    f"{op} of {tag!r} on axis {self.axis!r}: tensor {i} {tuple(t.shape)} "
                    f"{t.dtype} is on {t.device}, but this run computes on {self.device} (the "
                    f"process group serves that device; NCCL rejects host tensors): create it "
                    f"on the compute device (device=...)")

    def _run(self, op: str, tag: str, nbytes: int, call, *, peers=None, async_op: bool = False,
             role: str = "", dtype: torch.dtype | None = None):
        """Record the op, issue it, and attach context to any failure."""
        self.ledger.record(op, axis=self.axis, tag=tag, group_size=self.size, nbytes=nbytes,
                           dtype=_dtype_name(dtype))

        def describe() -> str:
            who = f"group global ranks {self.ranks}" if peers is None else f"peer global rank(s) {peers}"
            return (f"{op} of {tag!r} ({nbytes} bytes) on axis {self.axis!r}, rank "
                    f"{self.ranks[self.rank]} with {who}" + (f", {role}" if role else ""))
        in_flight = self.ledger.in_flight
        token = in_flight.begin(describe)        # until the call returns (sync) or is issued (async)
        ranks = self.ranks if peers is None else peers
        start = time.perf_counter()
        try:
            result = call()
        except Exception as err:
            raise CommError(f"{describe()} failed: {_first_line(err)}", ranks) from err
        finally:
            self.ledger.add_blocked(time.perf_counter() - start)
            in_flight.end(token)
        if async_op:
            return _Work(result, describe, self.ledger, ranks)
        return result

    @contextlib.contextmanager
    def foreign_ops(self, what: str, *, also: list[Comm] | tuple = ()):
        """Wrap code in which another library issues ops on this group (DeepSpeed's ZeRO gradient
        reduction over dp inside engine.backward / engine.step): they are shown in flight while it
        runs, and a backend failure (a dead or stalled peer) becomes a CommError naming the axis
        and its ranks (and those of the groups in `also` the library may use in the same block).
        CommErrors of our own ops inside the block pass through unchanged."""
        def describe() -> str:
            axes = " or ".join(f"axis {c.axis!r} (global ranks {c.ranks})"
                               for c in (self, *also) if c.size > 1)
            return f"{what} on {axes or 'no group of more than one rank'}, rank {self.ranks[self.rank]}"
        token = self.ledger.in_flight.begin(describe)
        try:
            yield
        except CommError:
            raise
        except RuntimeError as err:
            if not is_backend_error(err):
                raise
            ranks = sorted({r for c in (self, *also) for r in c.ranks})
            raise CommError(f"{describe()} failed: {_first_line(err)}", ranks) from err
        finally:
            self.ledger.in_flight.end(token)

    # -- collectives ------------------------------------------------------------------------------
    def broadcast(self, tensor: torch.Tensor, src: int, *, tag: str, async_op: bool = False):
        self.check_device("broadcast", tag, tensor)
        if self.size == 1:
            return _Done() if async_op else None
        return self._run("broadcast", tag, _nbytes(tensor), lambda: dist.broadcast(
            tensor, src=self.ranks[src], group=self.group, async_op=async_op),
            async_op=async_op, role=f"source global rank {self.ranks[src]}", dtype=tensor.dtype)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, *, tag: str, async_op: bool = False):
        """out: [D * inp.shape[0], ...] (rank-major concatenation)."""
        self.check_device("all_gather", tag, out, inp)
        if self.size == 1:
            out.copy_(inp.reshape(out.shape))
            return _Done() if async_op else None
        if self.direct_exchanges and out.is_contiguous():
            call = self._direct(self._direct_all_gather, out, inp.contiguous(), async_op)
        else:
            def call():
                return dist.all_gather_single(out, inp.contiguous(), group=self.group, async_op=async_op)
        return self._run("all_gather", tag, _nbytes(out), call, async_op=async_op, dtype=out.dtype)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, *, tag: str, async_op: bool = False):
        """Sum over the group of inp [D * out.shape[0], ...]; this rank keeps block `rank`."""
        self.check_device("reduce_scatter", tag, out, inp)
        if self.size == 1:
            out.copy_(inp.reshape(out.shape))
            return _Done() if async_op else None
        if self.direct_exchanges and out.is_contiguous():
            call = self._direct(self._direct_reduce_scatter, out, inp.contiguous(), async_op)
        else:
            def call():
                return dist.reduce_scatter_single(out, inp.contiguous(), op=dist.ReduceOp.SUM,
                                                  group=self.group, async_op=async_op)
        return self._run("reduce_scatter", tag, _nbytes(inp), call, async_op=async_op, dtype=inp.dtype)

    # -- direct exchanges (gloo) ------------------------------------------------------------------
    @staticmethod
    def _direct(start, out, inp, async_op: bool):
        """A call for _run: issue the direct op; a blocking op also waits for it (inside _run, so
        a failure becomes the op's CommError)."""
        def call():
            work = start(out, inp)
            if async_op:
                return work
            work.wait()
            return None
        return call

    def _peers(self) -> list[int]:
        return [p for p in range(self.size) if p != self.rank]

    def _direct_all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> _DirectWork:
        """Send this rank's block to every peer and receive theirs straight into `out`'s blocks
        [D, ...] rank-major: (D - 1) blocks out and in per rank, as in a ring."""
        blocks = out.view(self.size, -1)
        blocks[self.rank].copy_(inp.view(-1))
        ops = [dist.P2POp(dist.isend, blocks[self.rank], self.ranks[p], self.group, P2PTag.ALL_GATHER)
               for p in self._peers()]
        ops += [dist.P2POp(dist.irecv, blocks[p], self.ranks[p], self.group, P2PTag.ALL_GATHER)
                for p in self._peers()]
        return _DirectWork(dist.batch_isend_irecv(ops))

    def _direct_reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> _DirectWork:
        """Send block p of the input to peer p, receive every peer's block `rank` into a scratch
        [D - 1, numel(out)]; wait() sums into out this rank's own block, then the peers' blocks in
        group-rank order (a fixed order: the result does not depend on arrival)."""
        blocks = inp.view(self.size, -1)
        peers = self._peers()
        got = blocks.new_empty((len(peers), blocks.shape[1]))
        ops = [dist.P2POp(dist.isend, blocks[p], self.ranks[p], self.group, P2PTag.REDUCE_SCATTER)
               for p in peers]
        ops += [dist.P2POp(dist.irecv, got[i], self.ranks[p], self.group, P2PTag.REDUCE_SCATTER)
                for i, p in enumerate(peers)]

        def finish() -> None:
            flat = out.view(-1)
            flat.copy_(blocks[self.rank])
            for i in range(len(peers)):
                flat.add_(got[i])
        return _DirectWork(dist.batch_isend_irecv(ops), finish)

    def reduce(self, tensor: torch.Tensor, dst: int, *, tag: str, async_op: bool = False):
        """Sum into `tensor` on group rank `dst` (other ranks' buffers are left undefined)."""
        self.check_device("reduce", tag, tensor)
        if self.size == 1:
            return _Done() if async_op else None
        return self._run("reduce", tag, _nbytes(tensor), lambda: dist.reduce(
            tensor, dst=self.ranks[dst], op=dist.ReduceOp.SUM, group=self.group, async_op=async_op),
            async_op=async_op, role=f"destination global rank {self.ranks[dst]}", dtype=tensor.dtype)

    def all_reduce(self, tensor: torch.Tensor, *, tag: str, op=dist.ReduceOp.SUM, async_op: bool = False):
        self.check_device("all_reduce", tag, tensor)
        if self.size == 1:
            return _Done() if async_op else None
        return self._run("all_reduce", tag, _nbytes(tensor), lambda: dist.all_reduce(
            tensor, op=op, group=self.group, async_op=async_op), async_op=async_op,
            dtype=tensor.dtype)

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
                 tag: str, p2p_tag: P2PTag = P2PTag.RING_WEIGHTS) -> list:
        """Post one isend and one irecv (batch_isend_irecv) to/from group ranks; returns works.
        `p2p_tag` keeps concurrent exchanges between the same pair apart (gloo matches by tag)."""
        self.check_device("send/recv", tag, send, recv)
        if self.size == 1:
            recv.copy_(send)
            return []
        self.ledger.record("send", axis=self.axis, tag=tag, group_size=self.size, nbytes=_nbytes(send),
                           dtype=_dtype_name(send.dtype))
        dst, src = self.ranks[send_to], self.ranks[recv_from]
        ops = [dist.P2POp(dist.isend, send, dst, self.group, p2p_tag),
               dist.P2POp(dist.irecv, recv, src, self.group, p2p_tag)]
        works = self._run("recv", tag, _nbytes(recv), lambda: dist.batch_isend_irecv(ops),
                          peers=[dst, src], dtype=recv.dtype)

        def describe() -> str:
            return (f"send/recv of {tag!r} ({_nbytes(send)} bytes) on axis {self.axis!r}, rank "
                    f"{self.ranks[self.rank]} sending to global rank {dst}, receiving from global "
                    f"rank {src}")
        return [_Work(w, describe, self.ledger, [dst, src]) for w in works]


def _backend(group) -> str:
    """The backend name of `group` ("gloo", "nccl", "fake", ...); "" for no group / no default."""
    if not dist.is_available() or not dist.is_initialized():
        return ""
    try:
        return str(dist.get_backend(group))
    except (RuntimeError, ValueError):
        return ""


def on_device(t: torch.Tensor, device: torch.device) -> bool:
    """t lives on `device` (an index-less device such as "cuda" matches any index)."""
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "" if dtype is None else str(dtype).removeprefix("torch.")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def is_backend_error(err: BaseException) -> bool:
    """A failure of the communication backend (peer gone, timeout, aborted communicator) rather
    than of the code around it: torch's DistError family (NCCL, store) or a gloo transport error
    (gloo raises plain RuntimeErrors whose message names its source file)."""
    return isinstance(err, dist.DistError) or "/gloo/" in str(err) or "Gloo" in str(err)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def wait_all(works) -> None:
    for w in works:
        w.wait()
