"""GEMM launches per layer of TSP's blocks, counted on gloo ranks: every matmul a block runs
(aten mm, addmm, addmm_, bmm, baddbmm: what nn.Linear and `@` reach the dispatcher as), forward
and backward, per tsp_recompute mode and head-bucket count. Per rank, with D ranks:

    attention forward    2 D     owner r: x [Wq; Wk; Wv]^T over all its buckets; o_proj over them
    attention backward   5 D     full: the qkv GEMM again, dA = dy W_o, dW_o, dW_qkv, dX
                         4 D     selective, none (the items are kept: no projection again)
    MLP forward          2 D     ring step: x [W_gate; W_up]^T, down_proj
    MLP backward         5 D     full, selective: gate|up again, dW_down, dp = dy W_down,
                                 [dW_gate; dW_up], dX
                         4 D     none (gate/up kept)

independent of parallel.head_buckets: buckets slice the owner's GEMMs, they add none."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers.dist import run_on_ranks

pytestmark = pytest.mark.distributed

GEMMS = ("mm", "addmm", "addmm_", "bmm", "baddbmm")


class _GemmCounter(TorchDispatchMode):
    """Counts the GEMM ops dispatched inside."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in GEMMS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _counted(fn) -> int:
    with _GemmCounter() as counter:
        fn()
    return counter.count


def _block_launches(rank, world, modes, bucket_counts):
    """{(mode, buckets): {"attn": (forward, backward), "mlp": (forward, backward)}} of layer 0."""
    from tsp_trainer.config import model_config
    from tsp_trainer.model import Transformer
    from tsp_trainer.model.layers import Rotary
    from tsp_trainer.parallel import zigzag
    from tsp_trainer.parallel.mesh import build_mesh
    from tsp_trainer.parallel.schemes import parallelize

    seq, h = 16 * world, 64
    cfg = model_config("tiny", hidden_size=h, num_heads=8, num_kv_heads=8, intermediate_size=128)
    mesh = build_mesh(world)
    rope = Rotary.build(zigzag.zigzag_runs(seq, rank, world), cfg.head_dim, cfg.rope_theta)
    out = {}
    for mode in modes:
        for buckets in bucket_counts:
            with torch.device("meta"):
                model = Transformer(cfg)
            parallelize(model, "tsp", mesh, seq_len=seq, init_seed=0, head_buckets=buckets,
                        tsp_recompute=mode)
            layer = model.layers[0]
            counts = {}
            for name, block in (("attn", lambda x: layer.self_attn(x, rope)), ("mlp", layer.mlp)):
                x = torch.randn(1, seq // world, h, requires_grad=True)
                y = []
                forward = _counted(lambda: y.append(block(x)))
                backward = _counted(lambda: y[0].sum().backward())
                counts[name] = (forward, backward)
            out[(mode, buckets)] = counts
    return out


def expected_launches(degree: int, mode: str) -> dict:
    """The module docstring's formulas: {"attn": (forward, backward), "mlp": (forward, backward)}."""
    keeps_items, keeps_gate_up = mode != "full", mode == "none"
    return {"attn": (2 * degree, (4 if keeps_items else 5) * degree),
            "mlp": (2 * degree, (4 if keeps_gate_up else 5) * degree)}


@pytest.mark.parametrize("world", [1, 2])
def test_gemm_launches_per_layer_follow_the_formula_and_not_the_buckets(world):
    modes, bucket_counts = ("full", "selective", "none"), (1, 2)
    for counts in run_on_ranks(_block_launches, world, modes, bucket_counts):
        for mode in modes:
            for buckets in bucket_counts:
                assert counts[(mode, buckets)] == expected_launches(world, mode), (mode, buckets, counts)
