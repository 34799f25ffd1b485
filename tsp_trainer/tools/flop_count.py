"""Executed FLOPs of real code: torch's flop_counter formulas (what `FlopCounterMode` counts) with
attention formulas that count what the kernels execute.

torch 2.13's flop_counter counts matmuls (mm, addmm, bmm, baddbmm; here also the in-place addmm_ and
the out_dtype overloads) and the fused SDPA ops, but it
counts every fused attention call as the full [n_q, n_k] rectangle ("We aren't accounting for
causal attention here") and has no formula for CPU's flash kernel
(`aten._scaled_dot_product_flash_attention_for_cpu` and its backward, the ops the CPU log-sum-exp
route of model/attention_lse.py runs). `ExecutedFlops` counts with torch's registry and these
formulas in place of its attention ones (nothing global is changed), the score entries the kernel
computes:

    visible(n_q, n_k) = n_q * n_k                           no mask
                      = n_q * (n_k - n_q) + n_q**2 / 2       causal, bottom-right aligned (n_k >= n_q)
                      = n_q**2 / 2                           causal, top-left aligned (n_q <= n_k)

(the diagonal block counted as half the square, as the model FLOPs count causal attention; the
exact n(n+1)/2 differs by 1/n). Per call, with B batch rows, H query heads (GQA broadcasts K/V
heads), head dims d_qk, d_v:

    forward  = 2 * B * H * visible * (d_qk + d_v)               S = Q K^T and O = P V
    backward = 2 * B * H * visible * (3 * d_qk + 2 * d_v)       S again (flash backward rebuilds P),
                                                                dP = dO V^T, dV = P^T dO,
                                                                dQ = dS K, dK = dS^T Q

which is torch's own split of the backward into five matmuls, restricted to the visible entries.
Which corner a causal call is aligned to is the kernel's: FlashAttention (SDPA's flash op,
`_flash_attention_forward`) aligns bottom-right; the memory-efficient kernel says so in
`custom_mask_type` (1 top-left, 2 bottom-right; SDPA's `is_causal` is top-left); cuDNN and CPU
flash align top-left (the project calls them causal on square blocks only, where both agree).
Varlen calls (document masking: cu_seqlens offsets) are counted per segment when the offsets are
real tensors, else as max-length segments, like torch's own formula.

Fused calls that the dry run stands in for with a footprint (plan/dry_run.py, attention="cuda")
report theirs through `record_attention`.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten

_TOP_LEFT, _BOTTOM_RIGHT = "top_left", "bottom_right"


def visible_scores(n_q: int, n_k: int, causal: str | None) -> float:
    """Score entries a kernel computes for n_q queries against n_k keys (module docstring)."""
    if causal is None:
        return float(n_q * n_k)
    if causal == _BOTTOM_RIGHT:
        if n_k >= n_q:
            return n_q * (n_k - n_q) + n_q * n_q / 2
        return n_k * n_k / 2
    if causal == _TOP_LEFT:
        if n_q <= n_k:
            return n_q * n_q / 2
        return n_k * n_k / 2 + (n_q - n_k) * n_k
    raise ValueError(f"causal={causal!r} must be None, {_TOP_LEFT!r} or {_BOTTOM_RIGHT!r}")


def attention_flops(batch_heads: int, n_q: int, n_k: int, d_qk: int, d_v: int, *,
                    causal: str | None, backward: bool) -> float:
    """FLOPs of one fused attention call (forward or backward) over `batch_heads` = B * H query
    heads (module docstring)."""
    vis = visible_scores(n_q, n_k, causal)
    per_score = (3 * d_qk + 2 * d_v) if backward else (d_qk + d_v)
    return 2.0 * batch_heads * vis * per_score


# -- the ops: arguments bound by their schema names ---------------------------------------------


def _bind(packet, args, kwargs) -> dict:
    """The op's arguments by name (its `default` overload's schema)."""
    names = [a.name for a in packet.default._schema.arguments]
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound


def _offsets(offsets, max_len) -> list[int] | None:
    """Segment lengths of cu_seqlens offsets; max_len per segment when they are fake (no values)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if offsets is None:
        return None
    if isinstance(offsets, FakeTensor) or offsets.device.type == "meta":
        return [int(max_len)] * (offsets.numel() - 1)
    return offsets.diff().tolist()


def _bhsd_flops(a: dict, *, causal: str | None, backward: bool, q="query", k="key", v="value") -> float:
    """q, k, v in SDPA's [B, H, T, d] layout."""
    b, h, n_q, d_qk = a[q].shape
    n_k, d_v = a[k].shape[2], a[v].shape[3]
    return attention_flops(b * h, n_q, n_k, d_qk, d_v, causal=causal, backward=backward)


def _packed_flops(a: dict, *, causal: str | None, backward: bool, cu_q: str, cu_k: str,
                  max_q: str, max_k: str) -> float:
    """q, k, v in the [B, T, H, d] layout of `_flash_attention_*` / `_efficient_attention_*`, or
    packed varlen ([total, H, d] or [1, total, H, d] with cu_seqlens offsets)."""
    query, key, value = a["query"], a["key"], a["value"]
    heads, d_qk, d_v = query.shape[-2], query.shape[-1], value.shape[-1]
    lengths_q, lengths_k = _offsets(a.get(cu_q), a.get(max_q)), _offsets(a.get(cu_k), a.get(max_k))
    if lengths_q is None:
        b, n_q = query.shape[0], query.shape[1]
        return attention_flops(b * heads, n_q, key.shape[1], d_qk, d_v, causal=causal, backward=backward)
    return sum(attention_flops(heads, n_q, n_k, d_qk, d_v, causal=causal, backward=backward)
               for n_q, n_k in zip(lengths_q, lengths_k, strict=True))


def _mask_type(value: int) -> str | None:
    return {0: None, 1: _TOP_LEFT, 2: _BOTTOM_RIGHT}[int(value)]


def _formula(packet, count):
    """A raw flop_counter formula (tensors, not shapes): count(bound arguments) -> FLOPs."""
    def formula(*args, out_val=None, **kwargs):
        return int(round(count(_bind(packet, args, kwargs))))
    return formula


def _causal(a: dict, corner: str) -> str | None:
    return corner if a.get("is_causal", False) else None


# (forward op, backward op, the corner a causal call aligns to); q, k, v in SDPA's [B, H, T, d]
_BHSD_OPS = (
    (aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_flash_attention_backward,
     _BOTTOM_RIGHT),
    (aten._scaled_dot_product_efficient_attention,
     aten._scaled_dot_product_efficient_attention_backward, _TOP_LEFT),
    (aten._scaled_dot_product_cudnn_attention, aten._scaled_dot_product_cudnn_attention_backward,
     _TOP_LEFT),
    # CPU flash: model/attention_lse.py's two parts, and CPU SDPA's square causal calls
    (aten._scaled_dot_product_flash_attention_for_cpu,
     aten._scaled_dot_product_flash_attention_for_cpu_backward, _TOP_LEFT),
)
# the kernels under SDPA (lower-right CausalBias and varlen calls): (forward op, backward op, the
# argument names of cu_seqlens q / k and max q / k); flash's causal is bottom-right, the
# memory-efficient kernel names its mask in custom_mask_type
_PACKED_OPS = (
    (aten._flash_attention_forward, aten._flash_attention_backward,
     ("cum_seq_q", "cum_seq_k", "max_q", "max_k")),
    (aten._efficient_attention_forward, aten._efficient_attention_backward,
     ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")),
)


def _packed_causal(a: dict) -> str | None:
    if "custom_mask_type" in a:
        return _mask_type(a["custom_mask_type"])
    return _causal(a, _BOTTOM_RIGHT)


def _attention_formulas() -> dict:
    """The op packet -> formula table that overrides torch's attention entries."""
    table = {}
    for forward, backward, corner in _BHSD_OPS:
        for packet, is_backward in ((forward, False), (backward, True)):
            table[packet] = _formula(packet, lambda a, c=corner, b=is_backward: _bhsd_flops(
                a, causal=_causal(a, c), backward=b))
    for forward, backward, (cu_q, cu_k, max_q, max_k) in _PACKED_OPS:
        for packet, is_backward in ((forward, False), (backward, True)):
            table[packet] = _formula(packet, lambda a, b=is_backward, n=(cu_q, cu_k, max_q, max_k):
                                     _packed_flops(a, causal=_packed_causal(a), backward=b, cu_q=n[0],
                                                   cu_k=n[1], max_q=n[2], max_k=n[3]))
    return table


# -- the counter ------------------------------------------------------------------------------

_ACTIVE: list["ExecutedFlops"] = []


class _CountingMode(TorchDispatchMode):
    """FlopCounterMode's dispatch half, minus two things that change what runs (and so what the
    dry run's memory tracker measures): its module tracker, which hooks every module's inputs and
    outputs for backward, and its decomposition of ops without a formula, which allocates other
    temporaries than the op's own kernel. Composite ops (linear, matmul, SDPA) reach a dispatch
    mode already decomposed into the ops the formulas cover."""

    def __init__(self, registry: dict):
        super().__init__()
        self.registry = registry
        self.counts: dict = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func._overloadpacket
        out = func(*args, **kwargs)
        if packet in self.registry:
            self.counts[packet] += self.registry[packet](*_without_out_dtype(func, args), **kwargs,
                                                         out_val=out)
        return out


def _without_out_dtype(func, args: tuple) -> tuple:
    """The arguments torch's matmul formulas take: the out_dtype overloads (mm.dtype,
    baddbmm.dtype_out, ...) pass the output dtype positionally after the tensors."""
    if func._overloadname in ("dtype", "dtype_out"):
        return tuple(a for a in args if not isinstance(a, torch.dtype))
    return args


class ExecutedFlops:
    """Context manager: FLOPs of every matmul and attention kernel run inside, with torch's
    flop_counter formulas and this module's attention formulas in place of its own.

        with ExecutedFlops() as flops:
            loss.backward()
        flops.total, flops.by_op      # FLOPs, {"aten.mm": ..., ...}
    """

    def __init__(self):
        # addmm_ (a GEMM accumulating into its input in place) counts as addmm
        self.mode = _CountingMode({**flop_registry, aten.addmm_: flop_registry[aten.addmm],
                                   **_attention_formulas()})

    def __enter__(self) -> "ExecutedFlops":
        self.mode.__enter__()
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self)
        self.mode.__exit__(*exc)

    def add(self, packet, flops: float) -> None:
        """Count `flops` under op `packet` (a call that ran without dispatching it)."""
        self.mode.counts[packet] += int(round(flops))

    @property
    def total(self) -> int:
        return int(sum(self.mode.counts.values()))

    @property
    def by_op(self) -> dict[str, int]:
        return {str(op): int(n) for op, n in self.mode.counts.items()}


def record_attention(q_shape, k_shape, v_shape, *, causal: str | None, backward: bool) -> None:
    """Count one flash attention call ([B, H, T, d] shapes) in every active `ExecutedFlops`: for
    calls stood in for by a footprint that dispatches no attention op."""
    if not _ACTIVE:
        return
    packet = (aten._scaled_dot_product_flash_attention_backward if backward
              else aten._scaled_dot_product_flash_attention)
    b, h, n_q, d_qk = q_shape
    flops = attention_flops(b * h, n_q, k_shape[2], d_qk, v_shape[3], causal=causal, backward=backward)
    for counter in _ACTIVE:
        counter.add(packet, flops)


__all__ = ["ExecutedFlops", "attention_flops", "record_attention", "visible_scores"]
