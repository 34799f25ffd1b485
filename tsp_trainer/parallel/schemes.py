"""One entry point for every parallel scheme: `parallelize(model, scheme, mesh, ...)` shards the
plain model in place and returns a `Parallelized` that knows how to lay out a batch for this rank,
which groups share a replica's tokens (for the loss count), and how to gather or load full state.

Schemes: "tsp" (this project's core); the baselines "tp", "tp_sp", "sp", "tp_x_sp" register
themselves in SCHEMES from parallel/baselines/.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from tsp_trainer.model.documents import Documents
from tsp_trainer.model.layers import PositionRuns
from tsp_trainer.model.transformer import Transformer
from tsp_trainer.parallel import zigzag
from tsp_trainer.parallel.apply import (ShardSpec, apply_tsp, gather_full, load_full_state_dict)
from tsp_trainer.parallel.comm import Comm
from tsp_trainer.parallel.mesh import Mesh


@dataclass
class Parallelized:
    """A sharded model plus what a training loop needs to drive it on this rank."""

    model: Transformer
    specs: dict[str, ShardSpec]
    scheme: str
    mesh: Mesh
    # Groups over which one replica's tokens are split: token counts and loss sums are summed
    # over them (and over dp for the global mean).
    token_comms: list[Comm]
    # Comm for each mesh axis a ShardSpec may name ("tsp", "tp", "sp", ...).
    axis_comms: dict[str, Comm]
    # (input_ids [B, S], labels [B, S]) -> this rank's (input_ids, labels, positions as runs)
    layout: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, PositionRuns]]
    info: dict = field(default_factory=dict)

    def local_batch(self, input_ids: torch.Tensor, labels: torch.Tensor,
                    documents: Documents | None = None):
        """This rank's (input_ids, labels, positions). `documents` (document masking: the full
        rows' document starts, model/documents.py) travels with the positions; each scheme's
        attention cuts its own query runs at those starts."""
        ids, labels, positions = self.layout(input_ids, labels)
        if documents is not None:
            positions = positions.with_documents(documents)
        return ids, labels, positions

    def loss_sum(self, input_ids, labels, positions):
        return self.model.loss_sum(input_ids, labels, positions)

    def token_stats(self, input_ids, labels, positions):
        """Per-token loss and argmax of this rank's tokens (the layout's order and `positions`),
        forward only. Which ranks hold a token: `token_comms` (each token once over them)."""
        return self.model.token_stats(input_ids, labels, positions)

    def gather_full_state_dict(self) -> dict[str, torch.Tensor]:
        return self._gather(self.model.state_dict())

    def gather_full_grads(self) -> dict[str, torch.Tensor]:
        return self._gather({n: p.grad for n, p in self.model.named_parameters()})

    def load_full_state_dict(self, full: dict[str, torch.Tensor]) -> None:
        load_full_state_dict(self.model, full, self.specs,
                             {axis: c.rank for axis, c in self.axis_comms.items()})

    def _gather(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # Gather axis by axis: a tensor sharded on two axes (tp x sp) is gathered on each in turn.
        out = dict(tensors)
        for axis, comm in self.axis_comms.items():
            axis_specs = {n: (s if s.axis == axis else ShardSpec(None)) for n, s in self.specs.items()}
            out = gather_full(out, axis_specs, comm)
        return out


def _tsp(model: Transformer, mesh: Mesh, *, seq_len: int | None, head_buckets: int = 1,
         init_seed: int | None = None, tsp_recompute: str = "full", **_) -> Parallelized:
    specs = apply_tsp(model, mesh.tsp, head_buckets=head_buckets, seq_len=seq_len, init_seed=init_seed,
                      recompute=tsp_recompute)
    rank, degree = mesh.tsp.rank, mesh.tsp.size

    def layout(ids, labels):
        return zigzag.shard_batch(ids, labels, rank, degree)

    return Parallelized(model, specs, "tsp", mesh, [mesh.tsp], {"tsp": mesh.tsp}, layout,
                        {"head_buckets": head_buckets, "tsp_recompute": tsp_recompute})


SCHEMES: dict[str, Callable[..., Parallelized]] = {"tsp": _tsp}


def parallelize(model: Transformer, scheme: str, mesh: Mesh, *, seq_len: int | None = None,
                head_buckets: int = 1, init_seed: int | None = None, **options) -> Parallelized:
    """Shard `model` in place for `scheme` on `mesh` (model-parallel degree = mesh.tsp.size)."""
    if scheme not in SCHEMES:
        raise ValueError(f"parallel.scheme={scheme!r} is not a known scheme; use one of {sorted(SCHEMES)}")
    return SCHEMES[scheme](model, mesh, seq_len=seq_len, head_buckets=head_buckets,
                           init_seed=init_seed, **options)


# The baselines import Parallelized and SCHEMES from this module and add their entries to SCHEMES,
# so they are imported last (either import order works; an error in them is not swallowed).
import tsp_trainer.parallel.baselines  # noqa: E402,F401
