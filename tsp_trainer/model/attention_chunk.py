"""Causal attention of the queries in hand against one chunk of keys at a time, merged over the
chunks by log-sum-exp, with a backward that needs one key chunk at a time: what sequence-chunked
attention runs (parallel/tsp/chunked.py gathers the chunks).

Queries and keys come as position runs, (start, stop, first position) each: a run's tokens sit at
consecutive positions. `plan_blocks` pairs query runs with key runs into blocks, each one kernel
call: "full" (every query sees every key: the keys end before the queries start) or "causal"
(queries and keys at the same positions, query i seeing keys 0..i). With document boundaries the
runs are cut at document starts first and only pieces of one document meet.

Forward, per chunk: each block's output and log-sum-exp merged into fp32 accumulators
[B, Hq, Tq, d] and [B, Hq, Tq]:  lse = logaddexp(lse_acc, lse_b),  out = w_acc out_acc + w_b out_b,
w_x = exp(lse_x - lse). Backward, per chunk: each block's kernel backward with the merged output
and lse gives its exact dQ part and its keys' dK, dV (any key subset's gradients are exact with
the final out/lse), so dK/dV of one chunk are complete once its blocks ran.

GQA without expanding K/V or dK/dV to the query heads: a full block stacks the G query heads of
each KV head along the query axis, q [B, Hq, n, d] -> [B, Hkv, G n, d] (no mask to break, so the
stacked rows are independent queries), and the kernel runs as multi-head attention on Hkv heads:
dK, dV [B, Hkv, n_k, d] come out of the kernel per KV head. A causal block (queries at the keys'
positions) runs once per group member g, query heads g, G + g, ... against the Hkv heads, dK, dV
summed over the G calls: [B, Hkv, n, d] each, never [B, Hq, n, d].
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

Runs = tuple[tuple[int, int, int], ...]


class Block(NamedTuple):
    """Queries q0..q1-1 against keys k0..k1-1 (indices in hand / in the chunk), full or causal."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


def _pieces(runs: Runs, starts: tuple[int, ...] | None):
    """Runs cut at document starts: (start, stop, first position, document index) each."""
    for start, stop, first in runs:
        if starts is None:
            yield start, stop, first, 0
            continue
        pos, end = first, first + stop - start
        while pos < end:
            doc = _document(starts, pos)
            nxt = starts[doc + 1] if doc + 1 < len(starts) else end
            cut = min(end, nxt)
            yield start + pos - first, start + cut - first, pos, doc
            pos = cut


def _document(starts: tuple[int, ...], pos: int) -> int:
    lo, hi = 0, len(starts) - 1
    while lo < hi:                                 # the last start <= pos
        mid = (lo + hi + 1) // 2
        if starts[mid] <= pos:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _pair(q, k) -> list[Block]:
    """The blocks of query piece q against key piece k (start, stop, first, doc) of one document."""
    qs, qe, qa, _ = q
    ks, ke, ka, _ = k
    qb, kb = qa + qe - qs, ka + ke - ks                  # positions [qa, qb), [ka, kb)
    if kb <= qa:                                         # every key before every query
        return [Block(qs, qe, ks, ke, False)]
    if ka >= qb:                                         # every key after every query
        return []
    a, b = max(qa, ka), min(qb, kb)                      # queries [a, b) meet their own keys
    qi, ki = (lambda p: qs + p - qa), (lambda p: ks + p - ka)
    out = []
    if a > ka:                                           # keys [ka, a) precede queries [a, b)
        out.append(Block(qi(a), qi(b), ki(ka), ki(a), False))
    out.append(Block(qi(a), qi(b), ki(a), ki(b), True))
    if b == kb and b < qb:                               # later queries see every key
        out.append(Block(qi(b), qe, ks, ke, False))
    return out


def _tiles(blk: Block, tile: int | None) -> list[Block]:
    """A block with at most `tile` queries per call: a full block cut along its queries; a causal
    square cut into query tiles, each a full block against the square's keys before it and a
    causal square of its own (so no call's temporaries outgrow a tile)."""
    if tile is None or blk.q1 - blk.q0 <= tile:
        return [blk]
    out = []
    for q0 in range(blk.q0, blk.q1, tile):
        q1 = min(blk.q1, q0 + tile)
        if not blk.causal:
            out.append(blk._replace(q0=q0, q1=q1))
            continue
        k0 = blk.k0 + (q0 - blk.q0)                      # the tile's own keys start here
        if k0 > blk.k0:
            out.append(Block(q0, q1, blk.k0, k0, False))
        out.append(Block(q0, q1, k0, k0 + q1 - q0, True))
    return out


@functools.lru_cache(maxsize=4096)
def plan_blocks(q_runs: Runs, k_runs: Runs, starts: tuple[int, ...] | None = None,
                tile: int | None = None) -> tuple[Block, ...]:
    """The kernel calls of queries `q_runs` against keys `k_runs` (both (start, stop, first
    position) runs), document boundaries `starts` (one row's, None: no document masking), at most
    `tile` queries a call (None: any). Full blocks over the same queries and adjacent keys are
    merged into one call. Host ints only, cached: every layer and bucket of a pass asks the same."""
    qp, kp = list(_pieces(q_runs, starts)), list(_pieces(k_runs, starts))
    blocks = [blk for q in qp for k in kp if q[3] == k[3] for blk in _pair(q, k)]
    full = sorted(b for b in blocks if not b.causal)
    merged: list[Block] = []
    for blk in full:
        last = merged[-1] if merged else None
        if last is not None and (last.q0, last.q1) == (blk.q0, blk.q1) and last.k1 == blk.k0:
            merged[-1] = last._replace(k1=blk.k1)
        else:
            merged.append(blk)
    return tuple(t for blk in merged + [b for b in blocks if b.causal] for t in _tiles(blk, tile))


# -- the kernel calls: q [B, H, n, d], k, v [B, H, n_k, d] with the same H (multi-head) ---------
_CPU_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _kernel_forward(q, k, v, causal: bool):
    """-> out [B, H, n, d] (q's dtype), lse [B, H, n] fp32. CUDA (and meta, whose shapes follow
    CUDA's kernel): flash attention's varlen call; elsewhere torch's CPU flash kernel."""
    if q.device.type not in ("cuda", "meta"):
        return _CPU_FWD(q, k, v, 0.0, causal)
    if q.device.type == "cuda" and q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"parallel.attention_chunk_tokens on CUDA runs flash attention, which takes "
                         f"bf16 or fp16, not {str(q.dtype).removeprefix('torch.')}; set train.dtype "
                         "to bf16 or parallel.attention_chunk_tokens=auto")
    b, h, n, d = q.shape
    nk = k.shape[2]
    qp, kp, vp, cu_q, cu_k = _packed(q, k, v)
    out, lse = torch.ops.aten._flash_attention_forward(qp, kp, vp, cu_q, cu_k, n, nk, 0.0, causal, False)[:2]
    # varlen flash: out [B n, H, d], lse [H, B n]
    return out.view(b, n, h, d).transpose(1, 2), lse.view(h, b, n).transpose(0, 1)


def _kernel_backward(dout, q, k, v, out, lse, causal: bool):
    """-> dq [B, H, n, d], dk, dv [B, H, n_k, d]."""
    if q.device.type not in ("cuda", "meta"):
        return _CPU_BWD(dout.contiguous(), q, k, v, out, lse, 0.0, causal)
    b, h, n, d = q.shape
    nk = k.shape[2]
    qp, kp, vp, cu_q, cu_k = _packed(q, k, v)
    dp, op = (t.transpose(1, 2).reshape(b * n, h, d) for t in (dout, out))
    lp = lse.transpose(0, 1).reshape(h, b * n).contiguous()
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)         # no dropout: not read
    dq, dk, dv = torch.ops.aten._flash_attention_backward(dp, qp, kp, vp, op, lp, cu_q, cu_k, n, nk, 0.0,
                                                          causal, rng, rng.new_zeros(()))
    return (dq.view(b, n, h, d).transpose(1, 2), dk.view(b, nk, h, d).transpose(1, 2),
            dv.view(b, nk, h, d).transpose(1, 2))


def _packed(q, k, v):
    """[B, H, n, d] -> varlen's [B n, H, d] with one sequence per row, and its int32 offsets."""
    b, h, n, d = q.shape
    nk = k.shape[2]
    qp = q.transpose(1, 2).reshape(b * n, h, d)
    kp, vp = (t.transpose(1, 2).reshape(b * nk, h, d) for t in (k, v))
    cu_q = torch.arange(0, (b + 1) * n, n, dtype=torch.int32, device=q.device)
    cu_k = torch.arange(0, (b + 1) * nk, nk, dtype=torch.int32, device=q.device)
    return qp, kp, vp, cu_q, cu_k


# -- one block, GQA native ---------------------------------------------------------------------
def _stack(t: torch.Tensor, hkv: int) -> torch.Tensor:
    """[B, Hq, n, *] -> [B, Hkv, G n, *]: the G query heads of each KV head one after another."""
    b, hq, n = t.shape[:3]
    return t.reshape(b, hkv, (hq // hkv) * n, *t.shape[3:])


def _unstack(t: torch.Tensor, hq: int) -> torch.Tensor:
    b, hkv, gn = t.shape[:3]
    return t.reshape(b, hq, gn * hkv // hq, *t.shape[3:])


def block_forward(q, k, v, causal: bool):
    """q [B, Hq, n, d], k, v [B, Hkv, n_k, d] -> out [B, Hq, n, d], lse [B, Hq, n] fp32."""
    hq, hkv = q.shape[1], k.shape[1]
    g = hq // hkv
    if not causal or g == 1:
        qs = _stack(q, hkv) if not causal else q
        out, lse = _kernel_forward(qs, k, v, causal)
        return (_unstack(out, hq), _unstack(lse, hq)) if not causal else (out, lse)
    out = q.new_empty(q.shape)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    for i in range(g):                                   # query heads i, G + i, ... per call
        out[:, i::g], lse[:, i::g] = _kernel_forward(q[:, i::g], k, v, True)
    return out, lse


def block_backward(dout, q, k, v, out, lse, causal: bool):
    """The block's dq [B, Hq, n, d] and dk, dv [B, Hkv, n_k, d] with the final out, lse."""
    hq, hkv = q.shape[1], k.shape[1]
    g = hq // hkv
    if not causal:
        dq, dk, dv = _kernel_backward(*(_stack(t, hkv) for t in (dout, q)), k, v,
                                      _stack(out, hkv), _stack(lse, hkv), False)
        return _unstack(dq, hq), dk, dv
    dq = q.new_empty(q.shape)
    dk = dv = None
    for i in range(g):
        dq[:, i::g], dk_i, dv_i = _kernel_backward(dout[:, i::g], q[:, i::g], k, v, out[:, i::g],
                                                   lse[:, i::g].contiguous(), True)
        dk, dv = (dk_i, dv_i) if dk is None else (dk.add_(dk_i), dv.add_(dv_i))
    return dq, dk, dv


# -- a chunk of keys ---------------------------------------------------------------------------
class MergedAttention:
    """The fp32 accumulators of queries q [B, Hq, Tq, d] over the key chunks: out [B, Hq, Tq, d]
    and lse [B, Hq, Tq] (-inf: no key seen yet)."""

    def __init__(self, q: torch.Tensor):
        self.out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        self.lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)

    def add(self, rows: slice, blk: Block, out: torch.Tensor, lse: torch.Tensor) -> None:
        acc_out, acc_lse = self.out[rows, :, blk.q0:blk.q1], self.lse[rows, :, blk.q0:blk.q1]
        new = torch.logaddexp(acc_lse, lse)
        acc_out.mul_(torch.exp(acc_lse - new).unsqueeze(-1)).add_(
            out.float() * torch.exp(lse - new).unsqueeze(-1))
        acc_lse.copy_(new)


def row_plans(q_runs: Runs, k_runs: Runs, documents, tile: int | None):
    """(rows, blocks) pairs: all rows at once without documents, else one per row."""
    if documents is None:
        return [(slice(None), plan_blocks(q_runs, k_runs, None, tile))]
    return [(slice(i, i + 1), plan_blocks(q_runs, k_runs, tuple(s), tile))
            for i, s in enumerate(documents.starts)]


def chunk_forward(merged: MergedAttention, q, k, v, q_runs: Runs, k_runs: Runs, documents=None,
                  tile: int | None = None) -> None:
    """Add keys k, v [B, Hkv, n_k, d] at `k_runs` to queries q [B, Hq, Tq, d] at `q_runs`, at most
    `tile` queries a kernel call."""
    for rows, blocks in row_plans(q_runs, k_runs, documents, tile):
        for blk in blocks:
            out, lse = block_forward(q[rows, :, blk.q0:blk.q1], k[rows, :, blk.k0:blk.k1],
                                     v[rows, :, blk.k0:blk.k1], blk.causal)
            merged.add(rows, blk, out, lse)


def chunk_backward(dout, q, k, v, out, lse, q_runs: Runs, k_runs: Runs, dq: torch.Tensor,
                   dk: torch.Tensor, dv: torch.Tensor, documents=None, tile: int | None = None) -> None:
    """One key chunk's part of the backward: dq [B, Hq, Tq, d] (fp32) += its part, dk, dv
    [B, Hkv, n_k, d] += the chunk's key gradients. out, lse: the merged forward's (final)."""
    for rows, blocks in row_plans(q_runs, k_runs, documents, tile):
        for blk in blocks:
            qs = slice(blk.q0, blk.q1)
            ks = slice(blk.k0, blk.k1)
            dq_b, dk_b, dv_b = block_backward(dout[rows, :, qs], q[rows, :, qs], k[rows, :, ks],
                                              v[rows, :, ks], out[rows, :, qs],
                                              lse[rows, :, qs].contiguous(), blk.causal)
            dq[rows, :, qs] += dq_b
            dk[rows, :, ks] += dk_b
            dv[rows, :, ks] += dv_b
