"""Where each rank runs: its node (the launcher that started it) and its host, gathered once at
start-up over the world group. The run logs it, says whether each TSP group stays inside one node,
and a failed collective names the nodes on the other side of it.

    placement = gather_placement(mesh.world)       # collective: every rank, once, after build_mesh
    placement.describe(mesh.dims)
    # "node 0 (host a): ranks [0, 1]; node 1 (host a): ranks [2, 3]; tsp groups [[0, 1], [2, 3]]
    #  each in one node; dp groups [[0, 2], [1, 3]] across nodes [0, 1]"
    placement.split_tsp_groups(mesh.dims)          # TSP groups spanning nodes: [] when node-local
    placement.other_nodes([0, 2], me=2)            # "node 0 (host a, ranks [0, 1])"

A process's node is its launcher's node rank: GROUP_RANK (torch elastic, which torchrun and
`accelerate launch` both run: --node_rank / --machine_rank), else SLURM_NODEID (srun starting the
ranks itself), else 0. Two launchers on one machine are two nodes on one host."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from tsp_trainer.parallel.comm import Comm
from tsp_trainer.parallel.mesh import ParallelDims

NODE_RANK_VARS = ("GROUP_RANK", "SLURM_NODEID")


def local_node(environ=os.environ) -> int:
    """This process's node rank, from the first of NODE_RANK_VARS its launcher set (0: none)."""
    for name in NODE_RANK_VARS:
        if environ.get(name, "").isdigit():
            return int(environ[name])
    return 0


@dataclass(frozen=True)
class Placement:
    nodes: tuple[int, ...]        # node rank of each global rank
    hosts: tuple[str, ...]        # host name of each global rank

    def ranks_of_node(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.nodes) if n == node]

    def node_label(self, node: int, *, with_ranks: bool = False) -> str:
        """'node 1 (host a)', or 'node 1 (host a, ranks [2, 3])'."""
        ranks = self.ranks_of_node(node)
        hosts = sorted({self.hosts[r] for r in ranks})
        where = f"host {', '.join(hosts)}" + (f", ranks {ranks}" if with_ranks else "")
        return f"node {node} ({where})"

    def where(self, rank: int) -> str:
        """'node 1 (host a)': the node and host of a global rank."""
        return self.node_label(self.nodes[rank])

    def split_tsp_groups(self, dims: ParallelDims) -> list[list[int]]:
        """The TSP groups whose ranks sit on more than one node (their traffic crosses the network)."""
        groups = [dims.tsp_group_ranks(d) for d in range(dims.dp)]
        return [g for g in groups if len({self.nodes[r] for r in g}) > 1]

    def describe(self, dims: ParallelDims) -> str:
        """Each node's ranks, then whether the TSP groups stay in one node and which nodes the DP
        groups cross (one line for the start-up log)."""
        per_node = "; ".join(f"{self.node_label(n)}: ranks {self.ranks_of_node(n)}"
                             for n in sorted(set(self.nodes)))
        tsp = [dims.tsp_group_ranks(d) for d in range(dims.dp)]
        dp = [dims.dp_group_ranks(t) for t in range(dims.tsp)]
        split = self.split_tsp_groups(dims)
        tsp_text = (f"tsp groups {tsp} each in one node" if not split
                    else f"tsp groups {tsp}, of which {split} span nodes")
        dp_nodes = sorted({self.nodes[r] for g in dp for r in g})
        return f"{per_node}; {tsp_text}; dp groups {dp} across nodes {dp_nodes}"

    def other_nodes(self, ranks, *, me: int) -> str:
        """The nodes other than `me`'s among `ranks` (the peers of a failed op), labelled with
        host and ranks; '' when every one of them is on `me`'s node."""
        mine = self.nodes[me]
        others = sorted({self.nodes[r] for r in ranks if 0 <= r < len(self.nodes)} - {mine})
        return ", ".join(self.node_label(n, with_ranks=True) for n in others)

    def lost_contact(self, ranks, *, me: int) -> str:
        """The sentence a rank prints when a collective over `ranks` failed: which nodes it lost
        contact with (a killed launcher, a dead, stalled or unreachable node), or that the peers
        were on its own node. The latter follows the former: a node's first rank to fail has a peer
        on the lost node and names it, then exits, and a local peer waiting on it in a node-local
        collective fails next (it cannot know the cause, so it points to that line)."""
        others = self.other_nodes(ranks, me=me)
        if others:
            return f"lost contact with {others} (its launcher or node is gone, stalled, or unreachable)"
        return f"a peer on this node ({self.where(me)}) left first (its own line gives the cause)"


def gather_placement(world: Comm, environ=os.environ) -> Placement:
    """Collective over the world group: every rank's (node rank, host), in global rank order."""
    pairs = world.all_gather_object((local_node(environ), socket.gethostname()))
    return Placement(nodes=tuple(n for n, _ in pairs), hosts=tuple(h for _, h in pairs))


def place_ranks(world: Comm, dims: ParallelDims, log) -> Placement:
    """Collective: every rank's node and host (`gather_placement`), logged once by rank 0; a TSP
    group spanning nodes is a warning (its every layer's collectives would cross the network)."""
    placement = gather_placement(world)
    log.info(f"placement: {placement.describe(dims)}")
    split = placement.split_tsp_groups(dims)
    if split and world.rank == 0:
        log.warning(f"tsp groups {split} span nodes: give every node a multiple of "
                    f"parallel.tsp_degree={dims.tsp} processes")
    return placement
