"""DeepSpeed's view of the mesh: a Megatron-style `mpu` (plain getters, imports no deepspeed).

Model-parallel getters return the tsp group, data-parallel getters the dp group, so ZeRO shards
and reduces over dp only. Deliberately absent: `initialize_sequence_parallel` and the
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
