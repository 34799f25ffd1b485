"""Stand-in traffic for the peers of a fake process group: inside `CopyTraffic`, every Comm op
(parallel/comm.py) of N bytes also moves N bytes on this rank's device, so a one-GPU run of one
rank of a D-rank group pays for its communication in memory bandwidth and stream ordering.

torch's fake backend (plan/dry_run.py `fake_world`) completes collectives and P2P ops at once and
moves no data. On a GPU that leaves out everything NCCL costs the rank: its kernels read and write
HBM next to the model's, and the compute stream waits for them. `CopyTraffic` puts back a copy of
the op's payload (the bytes the ledger records: the output of an all-gather, the input of a
reduce-scatter, the tensor of a broadcast / reduce / all-reduce, the received block of a P2P
exchange) between two scratch buffers, ordered the way ProcessGroupNCCL orders its own kernels:

* the copy runs on a side stream of the op's process group, one for collectives and one for
  point-to-point ops (NCCL runs each communicator on its own stream), after an event recorded
  on the issuing stream (NCCL's stream waits for the inputs to be ready);
* a blocking op makes the issuing stream wait for the copy at once; an async op returns a work
  whose wait() makes the stream that waits wait for it, as NCCL's Work.wait() does.

On CPU the copies run synchronously on the host (no streams), so the same code path runs in the
CPU tests. What the copy does not reproduce: NVLink / network latency and bandwidth, NCCL's own
buffers (allocated outside torch's allocator), and its SM usage (torch issues a same-device copy
as one memcpy). The scratch buffers grow to twice the largest payload and are allocated through
torch: `scratch_bytes` says how much of the allocator's peak is theirs.

The hook wraps `Comm._run` (every tensor op of Comm goes through it) for the duration of the
block; ops of no bytes (barriers, pickled control messages) are left alone.
"""

from __future__ import annotations

import torch

from tsp_trainer.parallel.comm import Comm


class _TwinWork:
    """A backend Work whose wait() also orders the waiting stream after the op's copy."""

    def __init__(self, work, traffic: CopyTraffic, done):
        self._work, self._traffic, self._done = work, traffic, done

    def wait(self) -> bool:
        if self._work is not None:
            self._work.wait()
        self._traffic._wait_for(self._done)
        return True

    def is_completed(self) -> bool:
        return self._done is None or self._done.query()


class CopyTraffic:
    """Context manager: Comm ops issue device copies of their bytes (module docstring).

    Counts what it did: `copies`, `bytes`, `waits` (stream waits on a copy), `by_op`
    (op -> {"count", "bytes"}), and `scratch_bytes` (the two scratch buffers)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.copies = self.bytes = self.waits = 0
        self.by_op: dict[str, dict[str, int]] = {}
        self._src = self._dst = None
        self._streams: dict[tuple[int, str], object] = {}
        self._original = None

    @property
    def scratch_bytes(self) -> int:
        return 0 if self._src is None else 2 * self._src.numel()

    def scratch(self) -> list[torch.Tensor]:
        """The scratch buffers (for memory trackers to leave out, like NCCL's own buffers)."""
        return [] if self._src is None else [self._src, self._dst]

    def reset_counts(self) -> None:
        self.copies = self.bytes = self.waits = 0
        self.by_op = {}

    def __enter__(self) -> CopyTraffic:
        if self._original is not None:
            raise RuntimeError("CopyTraffic is already active")
        self._original = original = Comm._run
        traffic = self

        def run_with_traffic(comm, op, tag, nbytes, call, **kwargs):
            if nbytes == 0:
                return original(comm, op, tag, nbytes, call, **kwargs)
            kind = "p2p" if op == "recv" else "collective"
            return original(comm, op, tag, nbytes,
                            lambda: traffic._issue(comm, op, kind, nbytes, call()), **kwargs)

        Comm._run = run_with_traffic
        return self

    def __exit__(self, *exc) -> None:
        Comm._run, self._original = self._original, None
        if self.device.type == "cuda":
            for stream in self._streams.values():
                stream.synchronize()

    # -- one op -----------------------------------------------------------------------------------
    def _issue(self, comm: Comm, op: str, kind: str, nbytes: int, result):
        """Copy `nbytes` for the op whose backend call returned `result` (None: blocking; a Work
        or a list of Works: async), and return what the caller gets in its place."""
        done = self._copy(comm, kind, nbytes)
        self.copies += 1
        self.bytes += nbytes
        entry = self.by_op.setdefault(op, {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += nbytes
        if result is None:                      # blocking op: the issuing stream waits now
            self._wait_for(done)
            return None
        if isinstance(result, (list, tuple)):   # batch_isend_irecv: one work per P2P op
            return [_TwinWork(w, self, done) for w in result]
        return _TwinWork(result, self, done)

    def _copy(self, comm: Comm, kind: str, nbytes: int):
        """Issue the copy; the CUDA event that marks its end (None on CPU: already done)."""
        self._grow(nbytes)
        src, dst = self._src[:nbytes], self._dst[:nbytes]
        if self.device.type != "cuda":
            dst.copy_(src)
            return None
        stream = self._stream(comm, kind)
        ready = torch.cuda.Event()
        ready.record()                          # on the issuing (current) stream
        stream.wait_event(ready)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def _wait_for(self, done) -> None:
        self.waits += 1
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)

    def _stream(self, comm: Comm, kind: str):
        key = (id(comm.group), kind)
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device=self.device)
        return self._streams[key]

    def _grow(self, nbytes: int) -> None:
        """Scratch of at least `nbytes` each; growing waits for the copies that use the old ones
        (they run on side streams the allocator does not know of)."""
        if self._src is not None and self._src.numel() >= nbytes:
            return
        if self.device.type == "cuda":
            for stream in self._streams.values():
                stream.synchronize()
        self._src = self._dst = None
        self._src = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._dst = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
