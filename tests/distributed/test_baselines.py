"""Parity of the baselines (tp, tp_sp, sp, tp_x_sp) with one process, and their ledger bytes
against the closed-form formula of parallel/baselines/comm_model.py. fp32, rtol 1e-5 / atol 1e-6:
the same math as the reference, summed in a different order over ranks."""

from __future__ import annotations

import functools
import typing

import pytest
import torch

from tests.distributed.tsp_cases import init_model, make_batch, reference
from tests.helpers.dist import ForkedCases
from tsp_trainer.config import ModelConfig
from tsp_trainer.config.model import RopeScaling
from tsp_trainer.config.schema import Scheme
from tsp_trainer.model import Transformer
from tsp_trainer.parallel.baselines.comm_model import bytes_by_op, expected_ledger_bytes
from tsp_trainer.parallel.comm import Comm
from tsp_trainer.parallel.ledger import CommLedger
from tsp_trainer.parallel.loss import global_count, reduce_loss_value
from tsp_trainer.parallel.mesh import Mesh, ParallelDims, build_mesh
from tsp_trainer.parallel.schemes import SCHEMES, parallelize

pytestmark = pytest.mark.distributed

SEED, BATCH, SEQ = 7, 2, 32
CFGS = {
    "mha": ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
                       intermediate_size=128, max_seq_len=64),
    "gqa": ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=4,
                       intermediate_size=128, max_seq_len=64),
    # Llama with attention_bias + mlp_bias (every bias kind: sharded q/k/v/gate/up, replicated
    # o/down) and llama3 RoPE scaling from an 8-token original context (positions up to 31).
    "llama_bias": ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=4,
                              intermediate_size=128, max_seq_len=64, qkv_bias=True, o_bias=True,
                              mlp_bias=True, rope_scaling=RopeScaling(
                                  "llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=8)),
    # Qwen2: q/k/v biases only, yarn scaling.
    "qwen2": ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=4,
                         intermediate_size=128, max_seq_len=64, family="qwen2", qkv_bias=True,
                         rope_theta=1e6, rope_scaling=RopeScaling(
                             "yarn", factor=4.0, original_max_position_embeddings=8)),
    # one matrix for the embedding and the LM head (both gradients land on it)
    "tied": ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=4,
                        intermediate_size=128, max_seq_len=64, tie_embeddings=True),
}
TOL = dict(rtol=1e-5, atol=1e-6)
# Every case's ranks run in a fork shared with the next cases of its world size (ForkedCases).
RUNS = ForkedCases()

CASES = [(scheme, world, cfg, {}) for world in (2, 4) for scheme in ("tp", "tp_sp", "sp")
         for cfg in ("mha", "gqa")]
CASES += [(scheme, world, cfg, {}) for world in (2, 4) for scheme in ("tp", "tp_sp", "sp")
          for cfg in ("llama_bias", "qwen2")]
CASES += [("tp_x_sp", 4, "mha", {"tp_degree": 2, "sp_degree": 2}),
          ("tp_x_sp", 4, "llama_bias", {"tp_degree": 2, "sp_degree": 2}),
          ("tp_x_sp", 4, "llama_bias", {"tp_degree": 2, "sp_degree": 2, "tp_sequence_parallel": True}),
          ("tp_x_sp", 4, "qwen2", {"tp_degree": 2, "sp_degree": 2}),
          ("tp_x_sp", 4, "gqa", {"tp_degree": 2, "sp_degree": 2}),
          ("tp_x_sp", 4, "gqa", {"tp_degree": 2, "sp_degree": 2, "tp_sequence_parallel": True}),
          ("tp_x_sp", 2, "gqa", {"tp_degree": 1, "sp_degree": 2}),
          ("tp_x_sp", 2, "mha", {"tp_degree": 2, "sp_degree": 1})]


@functools.lru_cache(maxsize=None)
def _reference(cfg_name: str):
    cfg = CFGS[cfg_name]
    ids, labels = make_batch(cfg, BATCH, SEQ)
    return ids, labels, reference(cfg, SEED, ids, labels)


def _baseline_rank(rank, world, cfg, scheme, options, ids, labels, ref_logits):
    mesh = build_mesh(world)
    model = Transformer(cfg)
    init_model(model, SEED)
    par = parallelize(model, scheme, mesh, seq_len=ids.shape[1], **options)
    local_ids, local_labels, pos = par.local_batch(ids, labels)

    mesh.ledger.reset()
    loss_sum, count = par.loss_sum(local_ids, local_labels, pos)
    total = global_count(count, par.token_comms)
    (loss_sum / total).backward()
    summary = mesh.ledger.summary()
    ledger = {k: v["bytes"] for k, v in summary.items()}

    # The layout slices any [B, S, ...] tensor along dim 1: the reference logits of our tokens.
    expected_logits = par.local_batch(ref_logits, ref_logits)[0]
    torch.testing.assert_close(par.model(local_ids, pos), expected_logits, **TOL)
    return {"loss": reduce_loss_value(loss_sum, total, par.token_comms), "ledger": ledger,
            "grads": par.gather_full_grads(), "info": par.info,
            "loss_collectives": summary.get("all_reduce/head.ce", {"count": 0})["count"],
            "loss_chunk": model.lm_head.chunk_tokens(local_labels.numel()),
            "mlp_chunk": model.layers[0].mlp.tiling.chunk(local_labels.numel(), 4),
            "param_numel": sum(p.numel() for p in model.parameters())}


def _register(scheme, world, cfg_name, options) -> tuple:
    """Registers the case with RUNS; its key."""
    ids, labels, ref = _reference(cfg_name)
    key = (scheme, cfg_name, tuple(sorted(options.items())))
    return RUNS.add(world, key, _baseline_rank, CFGS[cfg_name], scheme, options, ids, labels, ref["logits"])


for _case in CASES:
    _register(*_case)


@pytest.mark.parametrize("scheme,world,cfg_name,options", CASES,
                         ids=[f"{s}-d{w}-{c}" + ("-" + "x".join(str(v) for v in o.values()) if o else "")
                              for s, w, c, o in CASES])
def test_baseline_parity_and_ledger(scheme, world, cfg_name, options):
    cfg = CFGS[cfg_name]
    ref = _reference(cfg_name)[2]
    results = RUNS.result(world, (scheme, cfg_name, tuple(sorted(options.items()))))
    expected_comm = expected_ledger_bytes(cfg, scheme, degree=world, batch=BATCH, seq_len=SEQ, **options)
    t = results[0]["info"]["tp_degree"]
    replicated = (2 * cfg.num_layers + 1) * cfg.hidden_size + cfg.num_layers * cfg.replicated_biases
    for rank, out in enumerate(results):
        assert out["loss"] == pytest.approx(ref["loss"], rel=1e-5), f"rank {rank} loss"
        assert out["grads"].keys() == ref["grads"].keys()
        for name, grad in ref["grads"].items():
            torch.testing.assert_close(out["grads"][name], grad, **TOL, msg=lambda m: f"rank {rank} {name}: {m}")
        assert out["ledger"] == expected_comm, f"rank {rank}: ledger {out['ledger']} != formula {expected_comm}"
        assert bytes_by_op(out["ledger"]) == bytes_by_op(expected_comm)
        # Weights: 1/T of every matrix (and of the q/k/v, gate/up biases) on each rank, norms and
        # o/down biases replicated (SP: T = 1, everything).
        assert out["param_numel"] == (cfg.num_params() - replicated) // t + replicated


# parallel.loss_chunk_tokens forcing several chunks (2 x 32 tokens: 64 tokens in the TP region of
# tp / tp_sp, 64 / S under sp): the same loss and gradients, the same bytes in the same three
# cross-entropy all-reduces.
TILED = [("tp", 2, "gqa", {}, 5), ("tp", 4, "tied", {}, 7), ("tp_sp", 2, "tied", {}, 5),
         ("tp_sp", 4, "llama_bias", {}, 9), ("sp", 2, "tied", {}, 5), ("sp", 4, "gqa", {}, 3),
         ("tp_x_sp", 4, "gqa", {"tp_degree": 2, "sp_degree": 2, "tp_sequence_parallel": True}, 5)]
for _s, _w, _c, _o, _k in TILED:
    _register(_s, _w, _c, {**_o, "loss_chunk_tokens": _k})


@pytest.mark.parametrize("scheme,world,cfg_name,options,chunk", TILED,
                         ids=[f"{s}-d{w}-{c}-chunk{k}" for s, w, c, _, k in TILED])
def test_tiled_loss_parity_and_ledger(scheme, world, cfg_name, options, chunk):
    for out in _tiled_parity_and_ledger(scheme, world, cfg_name, options, "loss_chunk_tokens", chunk):
        assert out["loss_collectives"] == (3 if out["info"]["tp_degree"] > 1 else 0)


def _tiled_parity_and_ledger(scheme, world, cfg_name, options, key, chunk):
    """Run with `key` (loss_chunk_tokens or mlp_chunk_tokens) = chunk: each rank's chunk, loss,
    gradients and ledger against one process and the closed form; the ranks' results."""
    cfg = CFGS[cfg_name]
    ref = _reference(cfg_name)[2]
    results = RUNS.result(world, (scheme, cfg_name, tuple(sorted({**options, key: chunk}.items()))))
    expected_comm = expected_ledger_bytes(cfg, scheme, degree=world, batch=BATCH, seq_len=SEQ, **options)
    for rank, out in enumerate(results):
        assert out[key.removesuffix("_tokens")] == chunk
        assert out["loss"] == pytest.approx(ref["loss"], rel=1e-5), f"rank {rank} loss"
        for name, grad in ref["grads"].items():
            torch.testing.assert_close(out["grads"][name], grad, **TOL, msg=lambda m: f"rank {rank} {name}: {m}")
        assert out["ledger"] == expected_comm
    return results


# parallel.mlp_chunk_tokens forcing several chunks of the TP region's tokens in the MLP's local
# matmuls (64 tokens in the region of tp / tp_sp, 64 / S under sp; the last chunk shorter): the same
# logits, loss and gradients, the same bytes in the same collectives.
TILED_MLP = [("tp", 2, "llama_bias", {}, 5), ("tp", 4, "qwen2", {}, 7), ("tp_sp", 2, "gqa", {}, 5),
             ("tp_sp", 4, "llama_bias", {}, 9), ("sp", 2, "llama_bias", {}, 5), ("sp", 4, "qwen2", {}, 3),
             ("tp_x_sp", 4, "llama_bias", {"tp_degree": 2, "sp_degree": 2, "tp_sequence_parallel": True}, 5)]
for _s, _w, _c, _o, _k in TILED_MLP:
    _register(_s, _w, _c, {**_o, "mlp_chunk_tokens": _k})


@pytest.mark.parametrize("scheme,world,cfg_name,options,chunk", TILED_MLP,
                         ids=[f"{s}-d{w}-{c}-chunk{k}" for s, w, c, _, k in TILED_MLP])
def test_tiled_mlp_parity_and_ledger(scheme, world, cfg_name, options, chunk):
    _tiled_parity_and_ledger(scheme, world, cfg_name, options, "mlp_chunk_tokens", chunk)


def test_the_table_of_schemes_is_the_configs_scheme_type():
    # parallel/schemes.py SCHEMES builds exactly the values parallel.scheme may take, in its order.
    assert tuple(SCHEMES) == typing.get_args(Scheme) == ("tsp", "tp", "tp_sp", "sp", "tp_x_sp", "ulysses")


def _fake_mesh(degree: int) -> Mesh:
    """A mesh whose Comms have no process group: enough for the checks that run before any op."""
    ledger = CommLedger()
    tsp = Comm(None, list(range(degree)), 0, ledger, "tsp")
    return Mesh(ParallelDims(degree, degree), 0, tsp, Comm(None, [0], 0, ledger, "dp"), tsp, ledger)


@pytest.mark.parametrize("scheme,cfg,degree,options,match", [
    ("tp", CFGS["gqa"].replace(num_heads=12, num_kv_heads=6, head_dim=8), 4, {},
     r"parallel.tsp_degree=4 and model.num_kv_heads=6 divide neither way"),
    ("tp", CFGS["mha"].replace(intermediate_size=130), 4, {}, r"model.intermediate_size=130"),
    ("sp", CFGS["mha"], 4, {"seq_len": 36}, r"data.seq_len=36 .* 8"),
    ("tp_sp", CFGS["mha"], 4, {"seq_len": 34}, r"data.seq_len=34"),
    ("tp_x_sp", CFGS["mha"], 4, {"tp_degree": 2, "sp_degree": 1}, r"tp_degree x parallel.sp_degree"),
    ("tp_x_sp", CFGS["mha"], 4, {}, r"needs parallel.tp_degree and parallel.sp_degree"),
    ("tp_x_sp", ModelConfig(vocab_size=240, hidden_size=48, num_heads=6, num_kv_heads=6,
                            intermediate_size=96), 6,
     {"tp_degree": 3, "sp_degree": 2, "seq_len": 44, "tp_sequence_parallel": True}, r"data.seq_len=44"),
    ("tp", CFGS["mha"], 2, {"tp_degree": 2}, r"parallel.tp_degree=2 is only used by"),
    ("sp", CFGS["mha"], 2, {"chunks": 3}, r"unknown option"),
])
def test_bad_shapes_raise_clear_errors(scheme, cfg, degree, options, match):
    with torch.device("meta"):
        model = Transformer(cfg)
    options = {"seq_len": 32, **options}
    with pytest.raises(ValueError, match=match):
        parallelize(model, scheme, _fake_mesh(degree), **options)
