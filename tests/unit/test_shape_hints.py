"""A divisibility refusal names the degrees that work and the schemes that run the shape; a
vocabulary no degree divides is no refusal (it is padded to a multiple of the degree inside)."""

from __future__ import annotations

import pytest

from tsp_trainer.config.model import ModelConfig
from tsp_trainer.config.validate import check_parallel_shapes


@pytest.mark.parametrize("cfg,scheme,degree,message", [
    # an MLP width only D = 1 splits; sp replicates the weights
    (ModelConfig(intermediate_size=131, num_kv_heads=2), "tsp", 2,
     "parallel.tsp_degree=2 does not divide model.intermediate_size=131; use one of 1; or "
     "parallel.scheme=sp (weights replicated) runs parallel.tsp_degree=2"),
    # 2 KV heads at D = 4: D 1 or 2, sp, or tp_x_sp 2 x 2
    (ModelConfig(num_heads=8, num_kv_heads=2), "tp", 4,
     "parallel.tsp_degree=4 does not divide model.num_kv_heads=2; use one of 1, 2; or "
     "parallel.scheme=sp (weights replicated) runs parallel.tsp_degree=4; or parallel.scheme=tp_x_sp "
     "with parallel.tp_degree x parallel.sp_degree in 2 x 2"),
])
def test_divisibility_refusal_names_degrees_and_schemes(cfg, scheme, degree, message):
    with pytest.raises(ValueError) as err:
        check_parallel_shapes(cfg, scheme=scheme, degree=degree, seq_len=64)
    assert str(err.value) == message
    # the schemes it names do run the shape
    check_parallel_shapes(cfg, scheme="sp", degree=degree, seq_len=64)


@pytest.mark.parametrize("scheme", ["tsp", "tp", "tp_sp"])
def test_any_vocabulary_size_runs(scheme):
    check_parallel_shapes(ModelConfig(vocab_size=1031, num_kv_heads=4), scheme=scheme, degree=4, seq_len=64)


def test_hint_leaves_out_a_scheme_the_sequence_does_not_split_for():
    # seq_len 36: zigzag at D = 4 needs a multiple of 8, so sp is not offered; 2 x 2 needs 4
    with pytest.raises(ValueError) as err:
        check_parallel_shapes(ModelConfig(num_heads=8, num_kv_heads=2), scheme="tsp", degree=4, seq_len=36)
    assert "scheme=sp " not in str(err.value) and str(err.value).endswith("in 2 x 2")
    # seq_len 34: neither
    with pytest.raises(ValueError) as err:
        check_parallel_shapes(ModelConfig(num_heads=8, num_kv_heads=2), scheme="tsp", degree=4, seq_len=34)
    assert str(err.value).endswith("use one of 1")
