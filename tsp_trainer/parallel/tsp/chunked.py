"""Sequence-chunked TSP attention (`parallel.attention_chunk_tokens`): an item's K/V gathered one
chunk at a time, never the whole sequence's.

Chunk j is the local tokens [j c, (j + 1) c) of every rank (c = the setting; the last chunk may be
shorter), all-gathered rank-major as [D, B, c, 2, H, d]: D c keys at the position runs of those
tokens (`key_runs`; zigzag: each rank's slice is one or two runs). The forward attends the
rank's queries to each chunk in turn and merges the chunks' outputs by log-sum-exp
(model/attention_chunk.py), chunk j + 1's gather in flight under chunk j's kernels. The item
keeps its output and log-sum-exp [B, Hq, T] (what the unchunked selective path keeps as its
attention graph). The backward re-gathers the chunks the same way; each chunk's dK/dV
[B, D c, 2, H, d] is complete when its blocks ran and is reduce-scattered to its owners at once
(in the gathered layout: the local slice [c, 2, H, d] comes back), while the next chunk computes;
dQ [B, Hq, T, d] accumulates in fp32 over the chunks. Alive per item: two K/V chunks, one dK/dV
chunk and one in flight, instead of the full [B, S, 2, H, d] K/V and dK/dV.

Under full recompute the backward runs the chunked forward first (one pass over the chunks for
out and lse), then the backward pass (a second): the K/V bytes of backward are twice the
unchunked path's. Bytes of forward and of the dK/dV reduce-scatter are the same.
"""

from __future__ import annotations

import torch

from tsp_trainer.model.attention_chunk import MergedAttention, chunk_backward, chunk_forward
from tsp_trainer.parallel.comm import Comm


def key_runs(degree: int, local_tokens: int, start: int, stop: int) -> tuple[tuple[int, int, int], ...]:
    """The (start, stop, first position) runs of chunk [start, stop) of every rank's zigzag tokens
    in the gathered chunk's rank-major order: rank p's slice at p (stop - start)."""
    half, n, runs = local_tokens // 2, stop - start, []
    for p in range(degree):
        for lo, hi, first in ((0, half, p * half), (half, local_tokens, (2 * degree - 1 - p) * half)):
            a, b = max(lo, start), min(hi, stop)
            if a < b:
                runs.append((p * n + a - start, p * n + b - start, first + a - lo))
    return tuple(runs)


class _ChunkGather:
    """Chunk [start, stop) of every rank's kv [B, T, 2, H, d] in flight; wait() -> [B, D c, 2, H, d]
    rank-major (a view of the gathered buffer when B = 1)."""

    def __init__(self, kv: torch.Tensor, comm: Comm, start: int, stop: int):
        self.start, self.stop, self.size = start, stop, comm.size
        part = kv[:, start:stop].contiguous()
        self.out = part.new_empty((comm.size * part.shape[0],) + part.shape[1:])
        self.work = comm.all_gather(self.out, part, tag="attn.kv", async_op=True)

    def wait(self) -> torch.Tensor:
        self.work.wait()
        g, self.out = self.out, None
        b = g.shape[0] // self.size
        g = g.view((self.size, b) + g.shape[1:])                         # [D, B, c, 2, H, d]
        return g.transpose(0, 1).reshape((b, -1) + g.shape[3:])


class _ChunkScatters:
    """The chunks' dK/dV reduce-scatters, one in flight: the summed local slices land in
    out [B, T, 2, H, d]."""

    def __init__(self, like: torch.Tensor, comm: Comm):
        self.comm, self.out, self._pending = comm, torch.empty_like(like), None

    def issue(self, dkv: torch.Tensor, start: int, stop: int) -> None:
        """dkv [B, D c, 2, H, d] (rank-major keys, fp32) of chunk [start, stop)."""
        b, d = dkv.shape[0], self.comm.size
        inp = dkv.view((b, d, -1) + dkv.shape[2:]).transpose(0, 1).to(self.out.dtype).contiguous()
        out = self.out[:, start:stop]
        dst = out if out.is_contiguous() else torch.empty_like(out)
        work = self.comm.reduce_scatter(dst, inp.view((-1,) + inp.shape[2:]), tag="attn.dkv", async_op=True)
        self._finish()
        self._pending = (work, inp, dst, out)

    def _finish(self) -> None:
        if self._pending is not None:
            work, _, dst, out = self._pending
            work.wait()
            if dst is not out:
                out.copy_(dst)
            self._pending = None

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's tokens' dK, dV [B, T, H, d] each (summed over the group)."""
        self._finish()
        return self.out[:, :, 0], self.out[:, :, 1]


class ChunkedItem:
    """One item (owner, head bucket) of TSP attention with its K/V in chunks of `chunk` local
    tokens: the interface of attention.py's _Item (attend, backward, regather, scatter)."""

    def __init__(self, q: torch.Tensor, kv: torch.Tensor, comm: Comm, chunk: int):
        self.q, self.kv, self.comm = q, kv, comm                # [B, T, hq_b, d], [B, T, 2, hkv_b, d]
        t = kv.shape[1]
        self.bounds = [(s, min(t, s + chunk)) for s in range(0, t, chunk)]
        # queries per kernel call: as many as the chunk's keys, so a call's stacked copies of
        # q, dout, out and its dq stay the size of a chunk, not of the rank's tokens
        self.tile = comm.size * chunk
        self.q_raw = self.k_raw = None
        self.a = self.out = self.lse = self.q_runs = self.documents = None
        self.gather: _ChunkGather | None = self._gather(0)

    def _gather(self, j: int) -> _ChunkGather | None:
        return _ChunkGather(self.kv, self.comm, *self.bounds[j]) if j < len(self.bounds) else None

    def regather(self) -> None:
        """Issue the first chunk's gather again (the backward's pass over the chunks)."""
        self.gather = self._gather(0)

    def _chunks(self):
        """(j, K/V of chunk j [B, D c, 2, H, d]), chunk j + 1's gather issued before j is used."""
        for j in range(len(self.bounds)):
            kv, self.gather = self.gather.wait(), self._gather(j + 1)
            yield j, kv

    def _runs(self, j: int):
        return key_runs(self.comm.size, self.kv.shape[1], *self.bounds[j])

    def attend(self, rope, *, graph: bool, drop_kv: bool = False) -> torch.Tensor:
        """a [B, T, hq_b d] over all chunks. graph: keep out and lse for backward; without drop_kv
        (full recompute's backward) the first chunk's gather is issued again for the backward."""
        qt = self.q.transpose(1, 2)                                             # [B, hq_b, T, d]
        merged = MergedAttention(qt)
        for j, kv in self._chunks():
            chunk_forward(merged, qt, kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2), rope.runs,
                          self._runs(j), rope.documents, self.tile)
        out = torch.empty(self.q.shape, dtype=self.q.dtype, device=self.q.device)   # [B, T, hq_b, d]
        out.copy_(merged.out.transpose(1, 2))
        a = out.view(out.shape[0], out.shape[1], -1)
        if graph:
            self.a, self.out, self.lse = a, out, merged.lse
            self.q_runs, self.documents = rope.runs, rope.documents
            if not drop_kv:
                self.regather()
        return a

    def backward(self, da: torch.Tensor):
        """dQ [B, T, hq_b, d] and the chunks' dK/dV scatters (their wait() gives this rank's
        tokens' dK, dV [B, T, hkv_b, d], summed over the group)."""
        b, t, hq, d = self.q.shape
        qt, out = self.q.transpose(1, 2), self.out.transpose(1, 2)
        dout = da.reshape(b, t, hq, d).transpose(1, 2)
        dq = torch.zeros(qt.shape, dtype=torch.float32, device=qt.device)
        scatters = _ChunkScatters(self.kv, self.comm)
        for j, kv in self._chunks():
            k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)    # [B, D c, 2, H, d]
            chunk_backward(dout, qt, k, v, out, self.lse, self.q_runs, self._runs(j), dq,
                           dkv[:, :, 0].transpose(1, 2), dkv[:, :, 1].transpose(1, 2), self.documents,
                           self.tile)
            del kv, k, v
            scatters.issue(dkv, *self.bounds[j])
        self.a = self.out = self.lse = None
        return dq.transpose(1, 2).to(self.q.dtype), scatters

    def scatter(self, dkv):
        """The backward's scatters are already issued, chunk by chunk."""
        return dkv
