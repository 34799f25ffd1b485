"""DeepSpeed's Ulysses attention layer, `deepspeed.sequence.layer.DistributedAttention`, for the
`ulysses` scheme (parallel/ulysses.py), which may not import DeepSpeed itself: the scheme builder
receives `distributed_attention` below through parallelize()'s options (`scheme_options`).

Our tensors are [B, T, H, d] (batch first): the layer scatters the heads (dim 2) and gathers the
sequence (dim 1), batch_dim_idx=0. Its all-to-alls go through deepspeed.comm, which wraps the
torch process group already built by the mesh (initialised here once if nothing did it yet, e.g.
outside the trainer's Accelerate start-up).
"""

from __future__ import annotations

import os
from typing import Callable

import torch
import torch.distributed as dist


def distributed_attention(local_attention: Callable, group) -> Callable:
    """local_attention(q, k, v, **kwargs) over [B, S, H/D, d] -> attend(q, k, v, **kwargs) over the
    local tokens [B, S/D, H, d] of the ranks of `group` (a torch ProcessGroup)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed.comm as ds_comm
    from deepspeed.sequence.layer import DistributedAttention

    if not ds_comm.is_initialized():
        ds_comm.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False,
                                 verbose=False)
    layer = DistributedAttention(local_attention, group, scatter_idx=2, gather_idx=1)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
        return layer(q, k, v, 0, None, **kwargs)

    return attend


def scheme_options(scheme: str, zero_stage: int = 0, head_chunks: int = 1) -> dict:
    """The engine's part of parallelize()'s options for a baseline `scheme`: DeepSpeed's
    DistributedAttention for `ulysses` and the head chunks it is called in
    (parallel.ulysses_head_chunks, resolved); under ZeRO-3 (sp and ulysses, config/validate.py) the
    weights left to DeepSpeed to shard and reduce (sharded_weights)."""
    options = ({"distributed_attention": distributed_attention, "ulysses_head_chunks": head_chunks}
               if scheme == "ulysses" else {})
    return options | ({"sharded_weights": True} if zero_stage == 3 else {})
