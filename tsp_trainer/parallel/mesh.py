"""The 2-D mesh dp x tsp (tsp innermost: a TSP group is D consecutive ranks, so it stays in a node).

Global rank r has tsp_rank = r % D and dp_rank = r // D. The DP group of a rank is the set of ranks
with the same tsp_rank: they hold the same weight shard and different data. Groups are created by
every rank in the same order (torch.distributed requires it) and handed out explicitly as `Comm`
objects; nothing here is global state."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from tsp_trainer.parallel.comm import Comm
from tsp_trainer.parallel.ledger import CommLedger


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    tsp: int

    def __post_init__(self) -> None:
        if self.tsp < 1:
            raise ValueError(f"parallel.tsp_degree={self.tsp} must be >= 1")
        if self.world_size % self.tsp:
            raise ValueError(f"world size {self.world_size} is not divisible by "
                             f"parallel.tsp_degree={self.tsp}; use a degree in "
                             f"{[d for d in range(1, self.world_size + 1) if self.world_size % d == 0]}")

    @property
    def dp(self) -> int:
        return self.world_size // self.tsp

    def coords(self, rank: int) -> tuple[int, int]:
        """(dp_rank, tsp_rank) of a global rank."""
        return rank // self.tsp, rank % self.tsp

    def tsp_group_ranks(self, dp_rank: int) -> list[int]:
        return [dp_rank * self.tsp + t for t in range(self.tsp)]

    def dp_group_ranks(self, tsp_rank: int) -> list[int]:
        return [d * self.tsp + tsp_rank for d in range(self.dp)]


class Mesh:
    """This rank's view of the mesh: its coordinates and one Comm per axis (sharing one ledger)."""

    def __init__(self, dims: ParallelDims, rank: int, tsp: Comm, dp: Comm, world: Comm,
                 ledger: CommLedger):
        self.dims, self.rank, self.ledger = dims, rank, ledger
        self.dp_rank, self.tsp_rank = dims.coords(rank)
        self.tsp, self.dp, self.world = tsp, dp, world

    def __repr__(self) -> str:
        return f"Mesh(rank={self.rank}, dp={self.dims.dp}, tsp={self.dims.tsp})"


def build_mesh(tsp_degree: int, *, ledger: CommLedger | None = None) -> Mesh:
    """Create the dp and tsp groups of the already-initialised default process group."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dims = ParallelDims(world, tsp_degree)
    ledger = ledger if ledger is not None else CommLedger()
    dp_rank, tsp_rank = dims.coords(rank)
    # Every rank must call new_group for every group, in the same order.
    tsp_groups = [dist.new_group(dims.tsp_group_ranks(d)) for d in range(dims.dp)]
    dp_groups = [dist.new_group(dims.dp_group_ranks(t)) for t in range(dims.tsp)]
    tsp = Comm(tsp_groups[dp_rank], dims.tsp_group_ranks(dp_rank), tsp_rank, ledger, "tsp")
    dp = Comm(dp_groups[tsp_rank], dims.dp_group_ranks(tsp_rank), dp_rank, ledger, "dp")
    world_comm = Comm(dist.group.WORLD, list(range(world)), rank, ledger, "world")
    return Mesh(dims, rank, tsp, dp, world_comm, ledger)
