"""Document masking for packed sequences: which keys each query may see, as host integers.

A query at position p attends to keys ds(p) .. p, ds(p) the first position of p's document (with
`reset_positions` RoPE also sees p - ds(p)). Boundaries travel as `Documents` (per row, host ints
read once from the loader), attached to the positions of the tokens in hand, and every scheme cuts
its own query runs at them: no rule ties documents to the zigzag chunks.

Attention is planned as segments, a query run cut at document starts, each attended bottom-right
causal against its document's keys: the work follows the squared document lengths, and no N x N
mask exists anywhere. A `Documents` lives for one micro-batch and builds each row's plan (and its
varlen offsets on a device) once, reused by every layer, bucket and recompute: no host work per
attention call.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class Documents:
    """Document starts per batch row (logical positions, sorted, first 0) and whether RoPE
    positions restart at each document."""

    starts: tuple[tuple[int, ...], ...]
    reset_positions: bool = False
    # q_runs -> one RowPlan per row, filled on first use (not part of the value: equality and
    # hashing see the boundaries only)
    _plans: dict = field(default_factory=dict, compare=False, repr=False)

    def plan(self, q_runs: tuple[tuple[int, int, int], ...]) -> tuple["RowPlan", ...]:
        """Per row, the segments of queries `q_runs` (start, stop, first position) under these
        boundaries: built at the first call for this query layout, the same objects after."""
        q_runs = tuple(tuple(run) for run in q_runs)
        rows = self._plans.get(q_runs)
        if rows is None:
            rows = self._plans[q_runs] = tuple(RowPlan(plan_segments(q_runs, s)) for s in self.starts)
        return rows

    @classmethod
    def from_ids(cls, document_ids: torch.Tensor, *, reset_positions: bool = False) -> "Documents":
        """From per-token document ids [B, S] (any ints; a change between neighbours starts a
        document). Reads the tensor: pass the loader's host copy, before it moves to a GPU."""
        ids = document_ids.detach().cpu()
        change = ids[:, 1:] != ids[:, :-1]                           # [B, S-1]
        starts = tuple((0,) + tuple(int(i) + 1 for i in row.nonzero().flatten().tolist())
                       for row in change)
        return cls(starts, reset_positions)

    @classmethod
    def from_lengths(cls, lengths: list[list[int]], *, reset_positions: bool = False) -> "Documents":
        """From document lengths per row (each row's lengths sum to its S)."""
        rows = []
        for row in lengths:
            if any(n < 1 for n in row):
                raise ValueError(f"document lengths {row} must be positive")
            starts = [0]
            for n in row[:-1]:
                starts.append(starts[-1] + n)
            rows.append(tuple(starts))
        return cls(tuple(rows), reset_positions)


class Segment(NamedTuple):
    """Queries q_start..q_stop-1 (token indices in hand) at positions k_stop - n .. k_stop - 1
    (n = q_stop - q_start), attending to keys k_start..k_stop-1 of the logical sequence."""

    q_start: int
    q_stop: int
    k_start: int
    k_stop: int

    @property
    def n_prefix(self) -> int:
        """Keys before the diagonal block (seen by every query of the segment)."""
        return self.k_stop - self.k_start - (self.q_stop - self.q_start)


def plan_segments(q_runs: tuple[tuple[int, int, int], ...],
                  doc_starts: tuple[int, ...] = (0,)) -> tuple[Segment, ...]:
    """Cut each query run (start, stop, first position) at the document starts inside it.
    Segments come in query order and tile the queries exactly (pure; host ints)."""
    out = []
    for start, stop, first in q_runs:
        last = first + (stop - start)                            # one past the run's last position
        i = bisect.bisect_right(doc_starts, first) - 1           # document holding `first`
        pos = first
        while pos < last:
            doc_start = doc_starts[i]
            doc_end = doc_starts[i + 1] if i + 1 < len(doc_starts) else last
            end = min(last, doc_end)
            out.append(Segment(start + pos - first, start + end - first, doc_start, end))
            pos, i = end, i + 1
    return tuple(out)


def rope_positions(runs: tuple[tuple[int, int], ...], docs: Documents, device=None) -> torch.Tensor:
    """RoPE positions [B, T] restarted per document: position - start of its document, for the
    tokens in hand (runs of (first position, length)). Built on `device` from host ints (one
    arange per piece; nothing copied from the host), from the plan attention reuses."""
    q_runs, start = [], 0
    for first, n in runs:
        q_runs.append((start, start + n, first))
        start += n
    rows = []
    for row in docs.plan(tuple(q_runs)):
        pieces = [torch.arange(s.k_stop - (s.q_stop - s.q_start) - s.k_start, s.k_stop - s.k_start,
                               device=device) for s in row.segments]
        rows.append(torch.cat(pieces))
    return torch.stack(rows)


# Up to this many segments a row's key index is one arange per segment; beyond, one vectorised
# build (a launch count independent of the number of documents).
FEW_SEGMENTS = 16


@dataclass(frozen=True)
class VarlenPlan:
    """One row's segments as a varlen attention call: queries are already packed in segment order
    (cu_q), keys are gathered per segment (key_index, cu_k); causal is bottom-right aligned."""

    cu_q: tuple[int, ...]           # [n_segments + 1] query offsets
    cu_k: tuple[int, ...]           # [n_segments + 1] offsets into the gathered keys
    max_q: int
    max_k: int
    key_ranges: tuple[tuple[int, int], ...]   # (k_start, k_stop) per segment, gathered in order

    def key_index(self, device=None) -> torch.Tensor:
        """Indices [cu_k[-1]] of the keys to gather, int64, made on `device`: one arange per
        segment, or for many segments (short documents in a long row) one arange over all of them
        shifted per segment, so the kernel launches do not grow with the document count."""
        if len(self.key_ranges) <= FEW_SEGMENTS:
            return torch.cat([torch.arange(a, b, device=device) for a, b in self.key_ranges])
        total = self.cu_k[-1]
        # key j of segment i is k_start_i + (j - cu_k_i): an arange [total] plus a per-segment shift
        shift = [a - offset for (a, _), offset in zip(self.key_ranges, self.cu_k)]
        counts = [b - a for a, b in self.key_ranges]
        per_segment = host_to_device(torch.tensor([shift, counts], dtype=torch.int64), device)
        shifts = torch.repeat_interleave(per_segment[0], per_segment[1], output_size=total)
        return torch.arange(total, device=device) + shifts

    def on(self, device: torch.device) -> "DeviceVarlen":
        """The plan with its key index and int32 offsets made on `device`."""
        return DeviceVarlen(self, self.key_index(device), device_offsets(self.cu_q, device),
                            device_offsets(self.cu_k, device))


class DeviceVarlen(NamedTuple):
    """A VarlenPlan's tensors on the compute device: key index [cu_k[-1]], cu_q, cu_k int32."""

    plan: VarlenPlan
    key_index: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor


# The varlen kernels take cu_seqlens as int32 (flash attention's and memory-efficient attention's
# contract): every offset, i.e. the total of the packed queries or of the gathered keys, must stay
# below 2^31. A TSP rank gathers about (2D + 1) / (2D) x S keys (S: the row's tokens), so rows of up
# to ~2.0e9 tokens fit.
INT32_OFFSET_LIMIT = 1 << 31


def device_offsets(offsets: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """int32 offsets on `device`, copied from pinned host memory without blocking the host."""
    if offsets and offsets[-1] >= INT32_OFFSET_LIMIT:          # offsets ascend: the last is the max
        raise ValueError(f"varlen offset {offsets[-1]} (queries or gathered keys of one row) does "
                         "not fit the int32 cu_seqlens of the attention kernels: it must be < 2^31")
    return host_to_device(torch.tensor(offsets, dtype=torch.int32, device="cpu"), device)


def host_to_device(host: torch.Tensor, device) -> torch.Tensor:
    """A small host tensor on `device`, through pinned memory to a CUDA device (no host wait)."""
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


class RowPlan:
    """One row's segments for one query layout, and their varlen call's tensors per device (made
    once, at the first varlen call on that device)."""

    def __init__(self, segments: tuple[Segment, ...]):
        self.segments = segments
        self._varlen: dict[torch.device, DeviceVarlen] = {}

    def varlen(self, device: torch.device) -> DeviceVarlen:
        on_device = self._varlen.get(device)
        if on_device is None:
            on_device = self._varlen[device] = varlen_plan(self.segments).on(device)
        return on_device


def varlen_plan(segments: tuple[Segment, ...]) -> VarlenPlan:
    """cu_seqlens and key ranges of a varlen kernel call for these segments (pure)."""
    cu_q, cu_k = [0], [0]
    for s in segments:
        cu_q.append(cu_q[-1] + s.q_stop - s.q_start)
        cu_k.append(cu_k[-1] + s.k_stop - s.k_start)
    return VarlenPlan(tuple(cu_q), tuple(cu_k), max(s.q_stop - s.q_start for s in segments),
                      max(s.k_stop - s.k_start for s in segments),
                      tuple((s.k_start, s.k_stop) for s in segments))
