"""The 2-D mesh dp x tsp (tsp innermost: a TSP group is D consecutive ranks, so it stays in a node).

Global rank r has tsp_rank = r % D and dp_rank = r // D. The DP group of a rank is the set of ranks
with the same tsp_rank: they hold the same weight shard and different data. Groups are created by
every rank in the same order (torch.distributed requires it) and handed out explicitly as `Comm`
objects; nothing here is global state.

Timeouts: `dist.new_group` without `timeout=` gets torch's backend default (30 minutes for gloo),
not the timeout the default group was created with (torch 2.13). Every group
created here gets `timeout_s` (the Trainer passes train.collective_timeout_s), or else the default
group's own timeout, so a stalled peer fails every axis within the same bound. Each group carries
its axis name as `group_desc`, which NCCL's watchdog prints when it aborts a timed-out op."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
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
        self.device = tsp.device                  # the run's compute device (all Comms share it)
        self.dp_rank, self.tsp_rank = dims.coords(rank)
        self.tsp, self.dp, self.world = tsp, dp, world

    def __repr__(self) -> str:
        return f"Mesh(rank={self.rank}, dp={self.dims.dp}, tsp={self.dims.tsp})"


def compute_device() -> torch.device:
    """The device the default process group serves: CUDA (this process's current device) under
    NCCL, the CPU otherwise (gloo, the dry run's fake group)."""
    if "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_mesh(tsp_degree: int, *, ledger: CommLedger | None = None,
               timeout_s: float | None = None, device: torch.device | str | None = None) -> Mesh:
    """Create the dp and tsp groups of the already-initialised default process group.

    Args:
        timeout_s: collective timeout of every group created (train.collective_timeout_s); None
            takes the default group's timeout.
        device: the run's compute device, which every Comm op checks its tensors against
            (default: the one the default group serves, `compute_device()`).
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    device = compute_device() if device is None else torch.device(device)
    dims = ParallelDims(world, tsp_degree)
    ledger = ledger if ledger is not None else CommLedger()
    timeout = group_timeout(timeout_s)
    dp_rank, tsp_rank = dims.coords(rank)
    # Every rank must call new_group for every group, in the same order.
    tsp_groups = [_new_group(dims.tsp_group_ranks(d), "tsp", timeout) for d in range(dims.dp)]
    dp_groups = [_new_group(dims.dp_group_ranks(t), "dp", timeout) for t in range(dims.tsp)]
    tsp = Comm(tsp_groups[dp_rank], dims.tsp_group_ranks(dp_rank), tsp_rank, ledger, "tsp",
               device=device)
    dp = Comm(dp_groups[tsp_rank], dims.dp_group_ranks(tsp_rank), dp_rank, ledger, "dp", device=device)
    world_comm = Comm(dist.group.WORLD, list(range(world)), rank, ledger, "world", device=device)
    return Mesh(dims, rank, tsp, dp, world_comm, ledger)


def group_timeout(timeout_s: float | None) -> datetime.timedelta | None:
    """`timeout_s` as a timedelta, or the default group's timeout when None (None again if the
    backend does not expose it, e.g. the planner's fake process group)."""
    if timeout_s is not None:
        return datetime.timedelta(seconds=timeout_s)
    default = dist.group.WORLD
    for device in (torch.device("cuda"), torch.device("cpu")):
        try:
            return default._get_backend(device).options._timeout
        except (RuntimeError, AttributeError):
            continue
    return None


def _new_group(ranks: list[int], axis: str, timeout: datetime.timedelta | None):
    return dist.new_group(ranks, timeout=timeout, group_desc=axis)


def axis_view(comm: Comm, axis: str) -> Comm:
    """The same process group under another axis name (no new group): the baselines name the D
    ranks of the inner axis "tp" or "sp" so the ledger and the ShardSpecs say which role they play."""
    return Comm(comm.group, comm.ranks, comm.rank, comm.ledger, axis, device=comm.device)


def build_tp_sp_comms(mesh: Mesh, tp_degree: int, sp_degree: int, *,
                      timeout_s: float | None = None) -> tuple[Comm, Comm]:
    """Split every tsp group (D = T x S consecutive ranks) into a tp and an sp sub-axis, tp innermost:
    tsp rank t has tp_rank = t % T and sp_rank = t // T. Returns this rank's (tp, sp) Comms.

    Collective: every rank must call it, with the same degrees, at the same point (each rank creates
    every subgroup of every replica, in the same order). Size-1 subgroups get no process group (Comm
    ops are local no-ops there)."""
    d = mesh.dims.tsp
    if tp_degree < 1 or sp_degree < 1 or tp_degree * sp_degree != d:
        pairs = ", ".join(f"{t} x {d // t}" for t in range(1, d + 1) if d % t == 0)
        raise ValueError(f"parallel.tp_degree x parallel.sp_degree = {tp_degree} x {sp_degree} is not "
                         f"parallel.tsp_degree={d}; use T x S in {pairs}")
    base = [mesh.dims.tsp_group_ranks(dp) for dp in range(mesh.dims.dp)]
    tp_groups = [[ranks[s * tp_degree + i] for i in range(tp_degree)] for ranks in base for s in range(sp_degree)]
    sp_groups = [[ranks[s * tp_degree + i] for s in range(sp_degree)] for ranks in base for i in range(tp_degree)]
    timeout = group_timeout(timeout_s)
    tp = _member_comm(tp_groups, mesh, "tp", timeout)
    sp = _member_comm(sp_groups, mesh, "sp", timeout)
    return tp, sp


def build_kv_comm(mesh: Mesh, kv_repeat: int, *, tp_degree: int | None = None,
                  timeout_s: float | None = None) -> Comm | None:
    """The ranks that hold copies of the same K/V head (K/V heads fewer than the weight split's
    degree): `kv_repeat` consecutive ranks of each weight-splitting group, whose copies' gradients
    are summed over this group. The weight-splitting group is the tsp group (tsp, tp, tp_sp) or,
    with `tp_degree` T < D, each tp sub-axis of tp_x_sp (tsp rank t: tp rank t % T, as
    build_tp_sp_comms). None when kv_repeat is 1 (no copies).

    Collective: every rank must call it at the same point with the same arguments."""
    if kv_repeat == 1:
        return None
    d = mesh.dims.tsp
    t = d if tp_degree is None else tp_degree
    base = [mesh.dims.tsp_group_ranks(dp) for dp in range(mesh.dims.dp)]
    weight_groups = [[ranks[s * t + i] for i in range(t)] for ranks in base for s in range(d // t)]
    kv_groups = [g[b * kv_repeat:(b + 1) * kv_repeat] for g in weight_groups for b in range(t // kv_repeat)]
    return _member_comm(kv_groups, mesh, "kv", group_timeout(timeout_s))


def _member_comm(groups: list[list[int]], mesh: Mesh, axis: str, timeout) -> Comm:
    """Create every group (same order on all ranks); return the Comm of the one holding this rank."""
    handles = [_new_group(g, axis, timeout) if len(g) > 1 else None for g in groups]
    for ranks, handle in zip(groups, handles):
        if mesh.rank in ranks:
            return Comm(handle, ranks, ranks.index(mesh.rank), mesh.ledger, axis,
                        device=mesh.tsp.device)
    raise AssertionError(f"rank {mesh.rank} is in no {axis} group of {groups}")
