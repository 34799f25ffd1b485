"""Bad TSP shapes fail with a ValueError naming the field, the value and the allowed values, before
any process-group work: apply_tsp is given a Comm whose group does not exist."""

import pytest
import torch

from tsp_trainer.config import model_config
from tsp_trainer.model import Transformer
from tsp_trainer.parallel.apply import apply_tsp
from tsp_trainer.parallel.comm import Comm
from tsp_trainer.parallel.ledger import CommLedger
from tsp_trainer.parallel.mesh import ParallelDims


def _comm(degree):
    # No process group exists in this process: any collective would raise a different error.
    return Comm(group=None, ranks=list(range(degree)), rank=0, ledger=CommLedger(), axis="tsp")


@pytest.mark.parametrize("overrides,degree,seq_len,pattern", [
    (dict(num_heads=6, num_kv_heads=6, hidden_size=48), 4, 32, r"parallel.tsp_degree=4 .*model.num_(kv_)?heads=6"),
    (dict(num_heads=12, num_kv_heads=6, hidden_size=48), 4, 32, r"parallel.tsp_degree=4 .*model.num_kv_heads=6"),
    (dict(num_heads=8, num_kv_heads=8, intermediate_size=130), 4, 32, r"parallel.tsp_degree=4 .*model.intermediate_size=130"),
    (dict(num_heads=8, num_kv_heads=8), 4, 36, r"data.seq_len=36"),
])
def test_indivisible_shapes_rejected_before_comm(overrides, degree, seq_len, pattern):
    cfg = model_config("tiny", **overrides)
    with torch.device("meta"):
        model = Transformer(cfg)
    with pytest.raises(ValueError, match=pattern):
        apply_tsp(model, _comm(degree), seq_len=seq_len, init_seed=0)


def test_error_lists_allowed_degrees():
    cfg = model_config("tiny", num_heads=8, num_kv_heads=8, intermediate_size=128)
    with torch.device("meta"):
        model = Transformer(cfg)
    with pytest.raises(ValueError, match=r"1, 2, 4"):
        apply_tsp(model, _comm(3), seq_len=48, init_seed=0)


def test_head_buckets_must_divide_local_kv_heads():
    cfg = model_config("tiny", num_heads=8, num_kv_heads=4)
    with torch.device("meta"):
        model = Transformer(cfg)
    with pytest.raises(ValueError, match=r"parallel.head_buckets=4"):
        apply_tsp(model, _comm(2), seq_len=32, head_buckets=4, init_seed=0)


def test_world_size_must_factor():
    with pytest.raises(ValueError, match=r"world size 6 .*parallel.tsp_degree=4"):
        ParallelDims(6, 4)
    assert ParallelDims(8, 2).dp == 4
    assert ParallelDims(8, 2).dp_group_ranks(1) == [1, 3, 5, 7]
    assert ParallelDims(8, 2).tsp_group_ranks(3) == [6, 7]
