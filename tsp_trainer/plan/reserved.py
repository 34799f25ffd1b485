"""GPU memory outside the planner's tensor model, per rank, and the pinned host memory of a node.

The activation model (activations.py, transients.py) counts the tensors the code allocates. Beside
them a CUDA run holds buffers that libraries allocate on their own; each is modelled here from its
source (docs/planner.md, "Memory beside the tensors", cites them) and added to the total:

  flash_dq_accum          FA2's backward accumulates dQ in fp32: [B, round128(n_q), H_q, round32(d)]
                          (flash_api.cpp mha_bwd, `dq_accum`), for the largest query run of a call
  flash_gqa_dkv_expanded  under GQA FA2's backward writes dK, dV per query head,
                          [B, n_k, H_q, d] each in the activation dtype, then sums them per K/V head
                          (`dk_expanded`, `dv_expanded`): the trainer's schemes hold it under
                          train.attention_gqa=fused (SDPA's fused GQA call); 0 under native, whose
                          calls take the KV heads only (model/attention_gqa.py, its buffers counted
                          in transients.py); the peers' stacks (peers.py) hold it. The fp32 route expands K/V itself (counted in
                          transients.py)
  flash_split_kv          FA2's forward splits the keys only when B H_q ceil(n_q / 64) fills less than
                          80% of the SMs (`num_splits_heuristic`); then fp32 partial outputs
                          [splits, B, H_q, n_q, round32(d)] and log-sum-exps [splits, B, H_q, n_q]
  nccl_buffers            per communicator, channel and connection one buffer per protocol:
                          Simple NCCL_BUFFSIZE (4 MiB), LL128 4,915,200 B, LL 524,288 B
  blas_workspaces         cuBLAS and cuBLASLt workspaces per stream that runs GEMMs (32 MiB each
                          on Hopper and later; torch's defaults)
  cuda_context            the CUDA context and loaded kernel images (outside the caching allocator;
                          an assumption to check with torch.cuda.mem_get_info on the first run)

The three flash terms exist only inside one attention backward (or forward) call and are counted on
top of the step's peak: an upper bound.

Pinned host memory (page-locked, counted against a container's memory limit and never swapped):
`pinned_host_per_node` = GPUs per node x (activation offload's host copies + the async checkpoint's
staging of this rank's weights and optimizer state, checkpoint/background.py HostStaging).
"""

from __future__ import annotations

from dataclasses import dataclass

from tsp_trainer.config import ModelConfig
from tsp_trainer.plan.layout import Layout
from tsp_trainer.plan.precision import Precision
from tsp_trainer.plan.transients import native_gqa

MiB = 1 << 20
# streaming multiprocessors (CUDA) / compute units (ROCm) per GPU: FA2's split-KV rule reads them
SMS = {"h100": 132, "h200": 132, "mi300x": 304}


@dataclass(frozen=True)
class ReserveAssumptions:
    """What the reserve assumes of the libraries (each an environment default)."""

    nccl_channels: int = 16                 # rings/trees NCCL builds on one NVLink node (up to 32)
    nccl_connections: int = 2               # per channel: the ring's and the tree's receive side
    nccl_buffsize: int = 4 * MiB            # NCCL_BUFFSIZE, Simple protocol
    nccl_ll128_buffsize: int = 4_915_200    # NCCL_LL128_BUFFSIZE default
    nccl_ll_buffsize: int = 524_288         # NCCL_LL_BUFFSIZE default
    blas_workspace: int = 32 * MiB          # per library and stream, Hopper and later
    gemm_streams: int = 1                   # the compute stream (comm and offload streams run no GEMM)
    cuda_context: int = 512 * MiB


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def flash_dq_accum_bytes(b: int, n_q: int, heads: int, head_dim: int) -> int:
    """FA2 backward's fp32 dQ accumulator for one call of n_q queries."""
    d_rounded = _round_up(head_dim, 32 if head_dim <= 128 else 64)
    return 4 * b * _round_up(n_q, 128) * heads * d_rounded


def flash_gqa_dkv_expanded_bytes(b: int, n_k: int, heads: int, kv_heads: int, head_dim: int,
                                 e: int) -> int:
    """FA2 backward's dK and dV per query head under GQA (0 without GQA)."""
    if heads == kv_heads:
        return 0
    return 2 * e * b * n_k * heads * _round_up(head_dim, 8)


def flash_split_kv_splits(b: int, n_q: int, n_k: int, heads: int, head_dim: int, sms: int) -> int:
    """An upper bound on FA2's forward split count: 1 when the grid nearly fills the GPU, else
    at most min(128, SMs, key blocks) (the heuristic then picks the smallest efficient count)."""
    work = b * heads * -(-n_q // 64)
    if work >= 0.8 * sms:
        return 1
    block_n = 256 if head_dim <= 64 else 128 if head_dim <= 128 else 64
    return max(1, min(128, sms, -(-n_k // block_n)))


def flash_split_kv_bytes(b: int, n_q: int, n_k: int, heads: int, head_dim: int, sms: int) -> int:
    splits = flash_split_kv_splits(b, n_q, n_k, heads, head_dim, sms)
    if splits == 1:
        return 0
    return 4 * splits * b * heads * n_q * (_round_up(head_dim, 32) + 1)


def nccl_buffer_bytes(communicators: int, a: ReserveAssumptions = ReserveAssumptions()) -> int:
    per_connection = a.nccl_buffsize + a.nccl_ll128_buffsize + a.nccl_ll_buffsize
    return communicators * a.nccl_channels * a.nccl_connections * per_connection


def communicators(layout: Layout) -> int:
    """NCCL communicators a rank holds: the world's, its model-parallel and its data-parallel
    group's (a group of one rank runs no collective and gets none)."""
    return 1 + (layout.degree > 1) + (layout.dp > 1)


def _attention_calls(cfg: ModelConfig, layout: Layout, seq_len: int) -> dict[str, int]:
    """Shape of the largest flash call per rank: queries, keys, query and K/V heads."""
    t, s_p, _ = layout.axes                         # weight split (heads), token split
    split_heads = t * (layout.head_buckets if layout.scheme == "tsp" else 1)
    # zigzag: two runs of S / 2 S_p queries, the last against all S keys; no token split: S queries
    n_q = seq_len // (2 * s_p) if s_p > 1 else seq_len
    return {"n_q": n_q, "n_k": seq_len, "heads": max(1, cfg.num_heads // split_heads),
            "kv_heads": max(1, cfg.num_kv_heads // split_heads)}


def reserved_memory(cfg: ModelConfig, layout: Layout, seq_len: int, prec: Precision, *,
                    gpu: str = "h100", a: ReserveAssumptions = ReserveAssumptions()) -> dict[str, int]:
    """Per-rank bytes of each reserve term (module docstring) and their "total"."""
    c, b, e = _attention_calls(cfg, layout, seq_len), layout.micro_batch, prec.act
    flash = e < 4                                   # bf16/fp16: the flash route (fp32: efficient)
    gqa = c["heads"] != c["kv_heads"]
    out = {"flash_dq_accum": flash_dq_accum_bytes(b, c["n_q"], c["heads"], cfg.head_dim) if flash else 0,
           # the flash route under GQA, attention_gqa native (model/attention_gqa.py): nothing per query head
           "flash_gqa_dkv_expanded": (0 if not flash or native_gqa(e, "cuda", gqa, cfg.head_dim,
                                                                  layout.attention_gqa) else
                                      flash_gqa_dkv_expanded_bytes(b, c["n_k"], c["heads"], c["kv_heads"],
                                                                   cfg.head_dim, e)),
           "flash_split_kv": (flash_split_kv_bytes(b, c["n_q"], c["n_k"], c["heads"], cfg.head_dim,
                                                   SMS.get(gpu, 132)) if flash else 0),
           # + the group of ranks sharing a K/V head, when K/V heads are fewer than the weight split
           "nccl_buffers": nccl_buffer_bytes(communicators(layout) + (cfg.kv_repeat(layout.axes[0]) > 1), a),
           "blas_workspaces": 2 * a.blas_workspace * a.gemm_streams,
           "cuda_context": a.cuda_context}
    out["total"] = sum(out.values())
    return out


def pinned_host_per_node(*, offloaded: int, staged: int, gpus_per_node: int,
                         pinned_staging: bool = True) -> dict[str, int]:
    """Page-locked host bytes of one node: each rank's offloaded activations (train.offload_activations)
    and its async checkpoint staging (checkpoint.async_save; pageable with pinned_staging=False)."""
    staging = staged if pinned_staging else 0
    return {"activation_offload": gpus_per_node * offloaded, "checkpoint_staging": gpus_per_node * staging,
            "total": gpus_per_node * (offloaded + staging)}


__all__ = ["ReserveAssumptions", "communicators", "flash_dq_accum_bytes", "flash_gqa_dkv_expanded_bytes",
           "flash_split_kv_bytes", "nccl_buffer_bytes", "pinned_host_per_node", "reserved_memory"]
