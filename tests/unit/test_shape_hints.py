"""A divisibility refusal names the degrees that work and the schemes that run the shape; a
vocabulary no degree divides is no refusal (it is padded to a multiple of the degree inside), nor
are K/V heads fewer than D when D is a multiple of them (each copied on D / n_kv ranks)."""

from __future__ import annotations

import pytest

from tsp_trainer.config.model import ModelConfig
from tsp_trainer.config.validate import check_parallel_shapes


@pytest.mark.parametrize("cfg,scheme,degree,message", [
    # an MLP width only D = 1 splits; sp replicates the weights
    (ModelConfig(intermediate_size=131, num_kv_heads=2), "tsp", 2,
     "parallel.tsp_degree=2 does not divide model.intermediate_size=131; use one of 1; or "
     "parallel.scheme=sp (weights replicated) runs parallel.tsp_degree=2"),
    # 6 KV heads at D = 4 (neither a divisor nor a multiple): D 1, 2, 3, 6 or 12 (divisors of the
    # 12 query heads and the MLP width, 6 | D or D | 6), sp, or tp_x_sp 2 x 2
    (ModelConfig(num_heads=12, num_kv_heads=6, head_dim=16, intermediate_size=384), "tp", 4,
     "parallel.tsp_degree=4 and model.num_kv_heads=6 divide neither way (K/V heads are split over the "
     "D ranks, or each copied on D / num_kv_heads ranks when fewer); use one of 1, 2, 3, 6, 12; or "
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
    cfg = ModelConfig(num_heads=12, num_kv_heads=6, head_dim=16)
    # seq_len 36: zigzag at D = 4 needs a multiple of 8, so sp is not offered; 2 x 2 needs 4
    with pytest.raises(ValueError) as err:
        check_parallel_shapes(cfg, scheme="tsp", degree=4, seq_len=36)
    assert "scheme=sp " not in str(err.value) and str(err.value).endswith("in 2 x 2")
    # seq_len 34: neither
    with pytest.raises(ValueError) as err:
        check_parallel_shapes(cfg, scheme="tsp", degree=4, seq_len=34)
    assert str(err.value).endswith("use one of 1")


@pytest.mark.parametrize("scheme,kw", [("tsp", {}), ("tp", {}), ("tp_sp", {}),
                                       ("tp_x_sp", {"tp_degree": 4, "sp_degree": 2})])
def test_kv_heads_fewer_than_the_degree_run_when_it_is_their_multiple(scheme, kw):
    degree = 8 if scheme == "tp_x_sp" else 4
    for n_kv in (1, 2):                              # MQA, GQA 8/2
        check_parallel_shapes(ModelConfig(num_heads=8, num_kv_heads=n_kv), scheme=scheme, degree=degree,
                              seq_len=64, **kw)


def test_one_copied_kv_head_per_shard_takes_no_head_buckets():
    with pytest.raises(ValueError) as err:
        check_parallel_shapes(ModelConfig(num_heads=8, num_kv_heads=2), scheme="tsp", degree=4, seq_len=64,
                              head_buckets=2)
    assert str(err.value) == ("parallel.head_buckets=2 with model.num_kv_heads=2 < parallel.tsp_degree=4: "
                              "each TSP weight shard holds one K/V head (a copy), which cannot be split; "
                              "use 1")
