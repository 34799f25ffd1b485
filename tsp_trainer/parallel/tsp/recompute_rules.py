"""Which attention routes `parallel.tsp_recompute=selective` (and `none`, which keeps the same
attention items) can run on.

Selective recompute (parallel/tsp/attention.py) keeps, per item and layer, the attention kernel's
autograd graph with the kernel's saved *views* of the gathered K/V dropped (a saved-tensor hook
keeps their geometry) and re-gathered in backward. That works only when the kernel saves views.
Two CUDA routes of model/attention_route.py save copies instead, which selective recompute would
keep for every item of every layer (D x n_b copies of a K/V bucket per layer, i.e. the whole
sequence's K/V of every head, on every rank):

  expand_kv (fp32 + GQA, memory-efficient kernel)   K/V repeated to the query heads:
                                                    [B, S, n_heads / (D n_b), d] each, per item
  document masking's varlen call (flash, efficient) each document's keys packed by index_select
                                                    into [sum of key ranges, kv heads, d]

Both are refused before any process group exists (the Trainer calls this beside
`check_cuda_attention`), naming what to set instead. Not under activation checkpointing: there the
trainer accepts only tsp_recompute=full, and the block's replay keeps its items, copies included,
for that one block's backward (parallel/tsp/kept.py; plan/activations.py `tsp_replay_kept` counts
the expanded copies), a bounded cost that keeps these routes open to checkpointed training. On CPU (the lse-merge route) the kernel saves
views, also under document masking (one call per segment, on slices).
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
