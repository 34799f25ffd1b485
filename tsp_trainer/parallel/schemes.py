"""One entry point for every parallel scheme: `parallelize(model, scheme, mesh, ...)` shards the
plain model in place and returns a `Parallelized` that knows how to lay out a batch for this rank,
which groups share a replica's tokens (for the loss count), and how to gather or load full state.

SCHEMES is the one table of schemes: "tsp" (this project's core, built here) and the baselines it
is compared with, "tp", "tp_sp", "sp", "tp_x_sp" (built in parallel/baselines/), and "ulysses"
(parallel/ulysses.py: its all-to-all attention comes from DeepSpeed through the `distributed_attention`
option, engine/ulysses.py). Its keys are the
values of the config's `Scheme` type (config/schema.py).
"""

from __future__ import annotations

from typing import Callable

from tsp_trainer.config.validate import check_parallel_shapes
from tsp_trainer.model.transformer import Transformer
from tsp_trainer.parallel import zigzag
from tsp_trainer.parallel.apply import apply_tsp
from tsp_trainer.parallel.baselines.apply import build_sp, build_tp, build_tp_sp, build_tp_x_sp
from tsp_trainer.parallel.mesh import Mesh, build_kv_comm
from tsp_trainer.parallel.parallelized import Parallelized
from tsp_trainer.parallel.ulysses import build_ulysses

__all__ = ["SCHEMES", "Parallelized", "parallelize"]


def _tsp(model: Transformer, mesh: Mesh, *, seq_len: int | None, head_buckets: int = 1,
         init_seed: int | None = None, tsp_recompute: str = "full",
         loss_chunk_tokens: int | str = "auto", mlp_chunk_tokens: int | str = "auto",
         checkpoint_replay_keeps: str = "all", attention_chunk_tokens: int | str = "auto",
         **_) -> Parallelized:
    check_parallel_shapes(model.cfg, scheme="tsp", degree=mesh.tsp.size, seq_len=seq_len,
                          head_buckets=head_buckets)      # before any group is made
    kv_comm = build_kv_comm(mesh, model.cfg.kv_repeat(mesh.tsp.size))
    specs = apply_tsp(model, mesh.tsp, head_buckets=head_buckets, seq_len=seq_len, init_seed=init_seed,
                      recompute=tsp_recompute, loss_chunk_tokens=loss_chunk_tokens,
                      mlp_chunk_tokens=mlp_chunk_tokens,
                      checkpoint_replay_keeps=checkpoint_replay_keeps, kv_comm=kv_comm,
                      attention_chunk_tokens=attention_chunk_tokens)
    rank, degree = mesh.tsp.rank, mesh.tsp.size

    def layout(ids, labels):
        return zigzag.shard_batch(ids, labels, rank, degree)

    return Parallelized(model, specs, "tsp", mesh, [mesh.tsp], {"tsp": mesh.tsp}, layout,
                        {"head_buckets": head_buckets, "tsp_recompute": tsp_recompute,
                         "checkpoint_replay_keeps": checkpoint_replay_keeps})


SCHEMES: dict[str, Callable[..., Parallelized]] = {
    "tsp": _tsp, "tp": build_tp, "tp_sp": build_tp_sp, "sp": build_sp, "tp_x_sp": build_tp_x_sp,
    "ulysses": build_ulysses,
}


def parallelize(model: Transformer, scheme: str, mesh: Mesh, *, seq_len: int | None = None,
                head_buckets: int = 1, init_seed: int | None = None, **options) -> Parallelized:
    """Shard `model` in place for `scheme` on `mesh` (model-parallel degree = mesh.tsp.size)."""
    if scheme not in SCHEMES:
        raise ValueError(f"parallel.scheme={scheme!r} is not a known scheme; use one of {sorted(SCHEMES)}")
    return SCHEMES[scheme](model, mesh, seq_len=seq_len, head_buckets=head_buckets,
                           init_seed=init_seed, **options)
