"""Schemes `sp` and `ulysses` with their weights sharded by DeepSpeed ZeRO-3 over every rank of the
axis x dp (parallel/sharded_weights.py): parity with one process on loss, logits and every gradient
(the ZeRO-3 partitions gathered with DeepSpeed's safe_get_full_grad), fp32, rtol 1e-5 / atol 1e-6,
on 1, 2 and 4 gloo ranks; GQA with K/V heads fewer than the degree, tied embeddings and per-head
norms (qwen3), document masking on and off, checkpointed blocks, loss and MLP in chunks. The
ledger's ZeRO-3 records (Zero3Traffic's closed form) equal the bytes DeepSpeed hands to
torch.distributed's all_gather_into_tensor and reduce_scatter_tensor (engine/zero3_bytes.py, the
counter tsp-bench reports). All cases of one world size
run in one fork."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.distributed.test_ulysses_parity import CFGS as ULYSSES_CFGS
from tests.distributed.test_ulysses_parity import SEQ, SEED, TOL, _positions
from tests.distributed.trainer_cases import (assert_matches_reference, assert_resume_as_matches_uninterrupted,
                                              reference_run, train_rank)
from tests.distributed.tsp_cases import init_model, make_batch
from tsp_trainer.config import ModelConfig
from tsp_trainer.engine.zero_state import zero3_full_on_owner, zero3_partition_of
from tests.helpers.dist import run_on_ranks
from tsp_trainer.engine.deepspeed import ds_config, mark_gather_units, skip_cpu_shm_build
from tsp_trainer.engine.ulysses import distributed_attention
from tsp_trainer.engine.zero3_bytes import ZeroCollectiveBytes
from tsp_trainer.model import Transformer
from tsp_trainer.model.activation_checkpoint import checkpointed_block
from tsp_trainer.parallel.loss import global_count, reduce_loss_value
from tsp_trainer.parallel.mesh import build_mesh
from tsp_trainer.parallel.mpu import ShardedWeightsMpu
from tsp_trainer.parallel.schemes import parallelize
from tsp_trainer.parallel.sharded_weights import Zero3Traffic

pytestmark = pytest.mark.distributed

CFGS = {**ULYSSES_CFGS,
        # sizes no rank count divides (50, 251 x 50, ...): ZeRO-3 pads each partition (sp only:
        # 5 heads)
        "odd": ModelConfig(vocab_size=251, hidden_size=50, num_layers=1, num_heads=5, num_kv_heads=1,
                           intermediate_size=77, max_seq_len=64, qkv_bias=True, o_bias=True)}
# (scheme, model, documents: None = off, else reset_positions, activation checkpointing, options)
CASES = [("ulysses", "mha", None, False, {}), ("ulysses", "gqa", True, False, {}),
         ("ulysses", "qwen3", False, False, {}),
         ("ulysses", "gqa", False, True, {"loss_chunk_tokens": 5, "mlp_chunk_tokens": 3}),
         ("sp", "mha", None, False, {}), ("sp", "gqa", True, False, {}), ("sp", "qwen3", False, True, {}),
         ("sp", "gqa", None, False, {"loss_chunk_tokens": 5, "mlp_chunk_tokens": 3}),
         ("sp", "odd", True, False, {})]
# the default suite's share (one fork per world size, a DeepSpeed engine per case): GQA with K/V
# heads fewer than D, documents, checkpointed blocks, chunks, tied embeddings, both schemes
QUICK = [("ulysses", "gqa", True, True, {"loss_chunk_tokens": 5, "mlp_chunk_tokens": 3}),
         ("ulysses", "qwen3", None, False, {}), ("sp", "gqa", False, True, {}), ("sp", "odd", True, False, {})]


@functools.lru_cache(maxsize=None)
def _reference(cfg_name: str, docs: bool | None):
    """One process, the plain model (packed rows masked by their documents when `docs` is set)."""
    cfg = CFGS[cfg_name]
    ids, labels = make_batch(cfg, 2, SEQ)
    model = Transformer(cfg)
    init_model(model, SEED)
    pos = _positions(docs)
    with torch.no_grad():
        logits = model(ids, pos)
    loss_sum, count = model.loss_sum(ids, labels, pos)
    (loss_sum / count).backward()
    return {"ids": ids, "labels": labels, "logits": logits, "loss": (loss_sum / count).item(),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _checkpoint_round_trip(model, world, expected: dict) -> list[str]:
    """Names whose weight, assembled on rank 0 from the ZeRO-3 partitions (the checkpoint's
    gather), is not the `expected` whole weight, or cut again into this rank's partition (its
    load) does not give back the partition."""
    w = world.size
    scratch = torch.empty(max(w * -(-p.ds_numel // w) for p in model.parameters()))
    bad = []
    for name, p in model.named_parameters():
        full, _ = zero3_full_on_owner(p, None, world=world, owner=0, scratch=scratch, weight=True)
        full = world.broadcast_object(None if full is None else full.clone())
        part, n = zero3_partition_of(p, full, world.rank), p.ds_tensor.numel()
        valid = max(0, min(n, p.ds_numel - world.rank * n))   # the padding past ds_numel is not data
        if not (torch.equal(full, expected[name])
                and torch.equal(part[:valid], p.ds_tensor.reshape(-1)[:valid])
                and not part[valid:].any()):
            bad.append(name)
    return bad


def _engine(model, mesh):
    import deepspeed

    mark_gather_units(model)
    cfg = ds_config(micro_batch=2, grad_accum=1, dp_degree=mesh.world.size, zero_stage=3,
                    max_grad_norm=0.0, bf16=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg,
                                      mpu=ShardedWeightsMpu(mesh), dist_init_required=False)
    return engine


def _sharded_rank(rank, world, cases, refs):
    from deepspeed.utils import safe_get_full_grad

    skip_cpu_shm_build()
    counter = ZeroCollectiveBytes().install()          # before DeepSpeed's comm backend binds the ops
    mesh = build_mesh(world)
    out = []
    for (scheme, cfg_name, docs, checkpointing, options), ref in zip(cases, refs, strict=True):
        model = Transformer(CFGS[cfg_name])
        init_model(model, SEED)
        extra = {"distributed_attention": distributed_attention} if scheme == "ulysses" else {}
        par = parallelize(model, scheme, mesh, seq_len=SEQ, sharded_weights=True, **options, **extra)
        if checkpointing:
            model.block_wrapper = checkpointed_block
        traffic = Zero3Traffic(model, mesh.world)            # from the whole parameters
        engine = _engine(model, mesh)
        round_trip_bad = _checkpoint_round_trip(model, mesh.world, ref["weights"])
        ids, labels, pos = par.local_batch(ref["ids"], ref["labels"],
                                           None if docs is None else _positions(docs).documents)
        counter.reset()
        with counter.counting():
            loss_sum, count = engine.module.loss_sum(ids, labels, pos)
            total = global_count(count, par.token_comms)
            # DeepSpeed averages the gradients over its W data-parallel ranks
            engine.backward(loss_sum * world / total)
        measured = dict(counter.bytes)
        mesh.ledger.reset()
        traffic.record(checkpointed=checkpointing)
        ledger = mesh.ledger.summary()
        grads = {n: safe_get_full_grad(p).clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            logits = engine.module(ids, pos)
        expected = par.local_batch(ref["logits"], ref["logits"])[0]
        out.append({"loss": reduce_loss_value(loss_sum, total, par.token_comms), "grads": grads,
                    "logits_err": (logits - expected).abs().max().item(),
                    "logits_ok": torch.allclose(logits, expected, **TOL),
                    "measured": measured, "ledger": ledger, "round_trip_bad": round_trip_bad})
        engine.destroy()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_weights_match_one_process(world):
    _check_parity(world, QUICK)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4])
def test_sharded_weights_match_one_process_all_cases(world):
    _check_parity(world, CASES)


def _check_parity(world: int, cases: list) -> None:
    refs = [_reference(cfg_name, docs) for _, cfg_name, docs, *_ in cases]
    results = run_on_ranks(_sharded_rank, world, cases, refs, timeout=600)
    for rank, per_case in enumerate(results):
        for case, ref, out in zip(cases, refs, per_case, strict=True):
            where = f"rank {rank} {case}"
            assert out["loss"] == pytest.approx(ref["loss"], rel=1e-5), where
            assert out["logits_ok"], f"{where}: logits off by {out['logits_err']}"
            assert out["grads"].keys() == ref["grads"].keys()
            for name, grad in ref["grads"].items():
                torch.testing.assert_close(out["grads"][name], grad, **TOL,
                                           msg=lambda m, w=where, n=name: f"{w} {n}: {m}")
            ledger = {k: v["bytes"] for k, v in out["ledger"].items()}
            gathered = ledger["all_gather/zero3.params"] + ledger["all_gather/zero3.params.backward"]
            assert out["measured"].get("all_gather", 0) == gathered, where
            assert out["measured"]["reduce_scatter"] == ledger["reduce_scatter/zero3.grads"], where
            assert gathered > 0 if world > 1 else gathered == 0, where
            assert out["round_trip_bad"] == [], where


# slow: in the default suite the Trainer runs ZeRO-3 in test_ulysses_parity.py's resume across
# schemes (tsp <-> ulysses, against the uninterrupted run)
@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["ulysses", "sp"])
def test_trainer_runs_zero3_like_one_process(scheme):
    """parallel.scheme sp / ulysses through the whole Trainer, zero.stage left to auto (ZeRO-3 over
    all 4 ranks = DP 2 x D 2, the tiny recipe, 4 steps), equals one process on the same global
    batches with the tolerances of tests/distributed/test_trainer.py; the loss goes down. An
    evaluation at step 2 (3 held-out batches: the dp replicas run 2 and 1 forward passes, on the
    weights gathered once) leaves the training as it was."""
    overrides = ["train.steps=4", "checkpoint.enabled=false", f"parallel.scheme={scheme}",
                 "train.eval_every=2", "train.eval_batches=3"]
    reference = reference_run(overrides, dp_degree=2)
    outs = run_on_ranks(train_rank, 4, overrides, timeout=600)
    assert outs[0]["dp_world_size"] == 4                   # DeepSpeed's data-parallel group: all ranks
    assert_matches_reference(outs, reference)


@pytest.mark.slow
@pytest.mark.parametrize("first,then", [("sp", "sp"), ("sp", "tsp")])
def test_resume_under_zero3(first, then, tmp_path):
    """A 5-step run of `first` (DP 2 x D 2, zero.stage auto: ZeRO-3 over all ranks for sp, ZeRO-1
    for tsp) saves step 3; resuming it as `then` trains steps 4 and 5 like the uninterrupted run:
    the same losses (rtol 1e-6) and final weights (the tolerances of
    tests/distributed/test_trainer.py). tsp <-> ulysses (ZeRO-3) in the default suite:
    tests/distributed/test_ulysses_parity.py test_resume_across_schemes."""
    assert_resume_as_matches_uninterrupted(first, then, tmp_path)


@pytest.mark.slow
def test_nan_step_is_skipped_under_zero3(tmp_path):
    """train.nonfinite=skip under ZeRO-3 (ulysses, 4 ranks): step 3's loss is NaN on rank 1 only,
    every rank skips that update (DeepSpeed's ZeRO-3 finds the gradient norm invalid), and the
    weights after 3 steps equal those after 2 clean steps."""
    from tests.distributed.fault_cases import assert_nan_step_is_skipped

    assert_nan_step_is_skipped(4, ["optim.warmup_steps=0", "optim.min_lr=3e-3", "checkpoint.every=2",
                                   "checkpoint.keep_last=10", "parallel.scheme=ulysses"], tmp_path)
