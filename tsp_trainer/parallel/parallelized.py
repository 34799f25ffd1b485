"""`Parallelized`: a sharded model plus what a training loop needs to drive it on this rank. Every
scheme builder (parallel/schemes.py for TSP, parallel/baselines/ for the others) returns one; it
lives in its own module so that the builders import it without importing the table of schemes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from tsp_trainer.model.documents import Documents
from tsp_trainer.model.layers import PositionRuns
from tsp_trainer.model.transformer import Transformer
from tsp_trainer.parallel.apply import ShardSpec, gather_full, load_full_state_dict
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
