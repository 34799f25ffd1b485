"""DeepSpeed's view of the mesh: a Megatron-style `mpu` (plain getters, imports no deepspeed).

TSPMpu (ZeRO 0-2, every scheme): model-parallel getters return the tsp group, data-parallel getters
the dp group, so ZeRO shards and reduces over dp only. ShardedWeightsMpu (ZeRO-3, sp and ulysses):
one data-parallel group of every rank. Deliberately absent: `initialize_sequence_parallel` and the
sequence(-data)-parallel getters, whose presence switches DeepSpeed to Ulysses semantics (ZeRO
would then reduce over dp x tsp and sum gradients of different weight shards;
docs/design.md, "DeepSpeed and Accelerate").
"""

from __future__ import annotations

from tsp_trainer.parallel.mesh import Mesh


class TSPMpu:
    def __init__(self, mesh: Mesh):
        self.mesh = mesh

    # model (tensor) parallel = the tsp axis
    def get_model_parallel_rank(self) -> int:
        return self.mesh.tsp.rank

    def get_model_parallel_world_size(self) -> int:
        return self.mesh.tsp.size

    def get_model_parallel_group(self):
        return self.mesh.tsp.group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.mesh.tsp.ranks[0]

    # data parallel = the dp axis (ranks holding the same shard)
    def get_data_parallel_rank(self) -> int:
        return self.mesh.dp.rank

    def get_data_parallel_world_size(self) -> int:
        return self.mesh.dp.size

    def get_data_parallel_group(self):
        return self.mesh.dp.group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.mesh.dp.ranks)

    # no pipeline
    def get_pipe_parallel_rank(self) -> int:
        return 0

    def get_pipe_parallel_world_size(self) -> int:
        return 1


class ShardedWeightsMpu:
    """DeepSpeed's view of the mesh when ZeRO-3 shards the weights over every rank (schemes `sp`
    and `ulysses`, whose ranks of one axis hold the same weights and see different tokens): no
    model parallelism, and one data-parallel group spanning the axis x dp (the whole mesh). ZeRO
    partitions each parameter over that group, gathers it for each use and reduce-scatters its
    gradient over the same ranks, averaged over their number (the Trainer scales each rank's loss
    sum by that number over the global token count, so the average is the global batch's mean).

    Model-parallel getters return group None, size 1: DeepSpeed reads None as an absent
    dimension (comm/pg_utils.is_parallel), so the gradient norm counts every partition once.
    The sequence-parallel getters stay absent: with them DeepSpeed 0.19.8's ZeRO-3 averages
    over the data-parallel group alone on one reduction path (contiguous buckets) and over the
    whole group on the other (reduce-scatter), which a loss scale cannot serve both."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_group(self):
        return None

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.mesh.rank

    def get_data_parallel_rank(self) -> int:
        return self.mesh.world.rank

    def get_data_parallel_world_size(self) -> int:
        return self.mesh.world.size

    def get_data_parallel_group(self):
        return self.mesh.world.group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.mesh.world.ranks)

    def get_pipe_parallel_rank(self) -> int:
        return 0

    def get_pipe_parallel_world_size(self) -> int:
        return 1
