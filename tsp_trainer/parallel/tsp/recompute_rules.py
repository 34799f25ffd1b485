"""Which attention routes `parallel.tsp_recompute=selective` (and `none`, which keeps the same
attention items) can run on.

Selective recompute keeps each item's attention graph with the kernel's saved views of the
gathered K/V dropped and re-gathered in backward; that works only when the kernel saves views. Two
CUDA routes save copies instead (fp32 + GQA's expanded K/V; document masking's packed varlen keys),
which would keep the whole sequence's K/V of every head on every rank: both are refused before any
process group exists, naming what to set instead. Under activation checkpointing they stay open:
the replay keeps its copies for one block only (tsp/kept.py).
"""

from __future__ import annotations

from tsp_trainer.model.attention_route import SdpaRoute


def check_selective_route(route: SdpaRoute, *, dtype: str, num_heads: int, num_kv_heads: int,
                          document_masking: bool, mode: str = "selective") -> None:
    """Raise ValueError when `route` (a CUDA route, `check_cuda_attention`) would make the
    attention kernel save copies of the gathered K/V under parallel.tsp_recompute=`mode`
    (selective or none: both keep the attention items)."""
    if route.expand_kv:
        raise ValueError(
            f"parallel.tsp_recompute={mode!r} on CUDA with train.dtype={dtype} and GQA "
            f"(model.num_heads={num_heads}, model.num_kv_heads={num_kv_heads}): the memory-efficient "
            f"kernel gets K/V expanded to the query heads, copies [B, S, heads, head_dim] that "
            f"tsp_recompute={mode!r} would keep for every head bucket of every layer instead of "
            f"re-gathering them; use train.dtype=bf16 (flash takes GQA as it is) or "
            f"parallel.tsp_recompute=full")
    if document_masking and route.kernel in ("flash", "efficient"):
        raise ValueError(
            f"parallel.tsp_recompute={mode!r} on CUDA with data.document_masking=true: the "
            f"{route.kernel} kernel's varlen call packs each document's keys into a copy [sum of "
            f"key ranges, kv heads, head_dim] that tsp_recompute={mode!r} would keep for every head "
            f"bucket of every layer instead of re-gathering it; set parallel.tsp_recompute=full "
            f"or data.document_masking=false")
