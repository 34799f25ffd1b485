"""run/placement.py: a rank's node from its launcher's environment, the start-up line, TSP groups
that span nodes, and the one line a rank prints when a collective fails (which node it lost)."""

from tsp_trainer.cli import comm_failure_line
from tsp_trainer.parallel.comm import CommError
from tsp_trainer.parallel.mesh import ParallelDims
from tsp_trainer.run.placement import Placement, local_node

TWO_NODES = Placement(nodes=(0, 0, 1, 1), hosts=("a", "a", "b", "b"))


def test_node_rank_from_torch_elastic_then_slurm_then_zero():
    assert local_node({"GROUP_RANK": "3", "SLURM_NODEID": "7"}) == 3
    assert local_node({"SLURM_NODEID": "7"}) == 7
    assert local_node({}) == 0


def test_describe_names_each_nodes_ranks_and_where_the_groups_are():
    assert TWO_NODES.describe(ParallelDims(4, 2)) == (
        "node 0 (host a): ranks [0, 1]; node 1 (host b): ranks [2, 3]; tsp groups [[0, 1], [2, 3]] "
        "each in one node; dp groups [[0, 2], [1, 3]] across nodes [0, 1]")
    assert TWO_NODES.split_tsp_groups(ParallelDims(4, 2)) == []


def test_a_tsp_group_across_nodes_is_found():
    dims = ParallelDims(4, 4)
    assert TWO_NODES.split_tsp_groups(dims) == [[0, 1, 2, 3]]
    assert "tsp groups [[0, 1, 2, 3]], of which [[0, 1, 2, 3]] span nodes" in TWO_NODES.describe(dims)


def test_failed_collective_names_the_other_node_or_says_the_peer_was_local():
    assert TWO_NODES.lost_contact([1, 3], me=1).startswith("lost contact with node 1 (host b, ranks [2, 3])")
    assert TWO_NODES.lost_contact([0, 1], me=1) == ("a peer on this node (node 0 (host a)) left first "
                                                     "(its own line gives the cause)")


def test_comm_failure_line_with_and_without_placement():
    err = CommError("all_reduce of 'loss' (4 bytes) on axis 'dp', rank 2 with group global ranks "
                    "[0, 2] failed: Connection closed by peer", [0, 2])
    line = comm_failure_line(err, 2, TWO_NODES)
    assert line.startswith("tsp-train: error (rank 2, node 1 (host b)): lost contact with node 0 "
                           "(host a, ranks [0, 1]) (its launcher or node is gone")
    assert line.endswith(": all_reduce of 'loss' (4 bytes) on axis 'dp', rank 2 with group global "
                         "ranks [0, 2] failed: Connection closed by peer")
    assert comm_failure_line(err, 2, None) == f"tsp-train: error (rank 2): a collective failed: {err}"
