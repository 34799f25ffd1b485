"""The GQA-native attention path (model/attention_gqa.py) under every scheme that calls
`attention_core` with grouped heads: TSP (zigzag runs against the gathered keys, head buckets,
selective recompute), the baselines (tp: square calls of a head shard; sp, tp_sp, tp_x_sp: zigzag
runs against gathered K/V) and ulysses (square calls after the all-to-all), with and without
activation checkpointing. Each runs on 2 and 4
gloo ranks with the native path (its CPU twin: the same per-group-member code on torch's CPU
flash kernel, tests/helpers/gqa_route.py) and must equal one process on the fused route (SDPA
enable_gqa, the log-sum-exp merge): the logits, the loss and every gradient, fp32, rtol 1e-5 / atol 1e-6,
document masking on and off (off: the plain model's loss; on: the sum over documents, each run
alone). One process: tests/unit/test_attention_gqa.py. A model built with attention_gqa=fused
(train.attention_gqa) hands it to every call of TSP, the context-parallel baselines and ulysses:
none takes the native path, and the result is the same."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.distributed.tsp_cases import init_model
from tests.helpers.dist import ForkedCases
from tests.helpers.gqa_route import native_gqa_route
from tests.unit.test_document_masking import per_document_reference
from tsp_trainer.config import ModelConfig
from tsp_trainer.model import Transformer
from tsp_trainer.model.activation_checkpoint import checkpointed_block
from tsp_trainer.model.documents import Documents
from tsp_trainer.model.layers import PositionRuns
from tsp_trainer.parallel.loss import global_count, reduce_loss_value
from tsp_trainer.parallel.mesh import build_mesh
from tsp_trainer.parallel.schemes import parallelize

pytestmark = pytest.mark.distributed

SEED, SEQ = 5, 32
# 12 query heads over 4 KV heads: G = 3 on every rank of 2 and 4 (3 or 6 query heads a rank)
CFG = ModelConfig(vocab_size=256, hidden_size=96, num_layers=2, num_heads=12, num_kv_heads=4,
                  intermediate_size=128, max_seq_len=64, qkv_bias=True, o_bias=True)
LENGTHS = [[5, 11, 1, 15], [3, 29]]
TOL = dict(rtol=1e-5, atol=1e-6)

# (scheme, world, options, document masking)
CASES = [("tsp", 2, {}, False), ("tsp", 2, {"head_buckets": 2}, True),
         ("tsp", 4, {}, True), ("tsp", 4, {"tsp_recompute": "selective"}, False),
         ("tp", 2, {}, True), ("tp", 4, {}, False),
         ("sp", 2, {}, False), ("sp", 4, {}, True),
         ("tp_sp", 2, {}, True),
         ("tp_x_sp", 4, {"tp_degree": 2, "sp_degree": 2}, False),
         ("ulysses", 2, {}, False), ("ulysses", 4, {}, True),
         # activation checkpointing: the blocks' replay runs the native forward again
         ("tsp", 4, {"checkpointing": True}, True), ("sp", 2, {"checkpointing": True}, False),
         # train.attention_gqa=fused reaches every attention call: no native call at all
         ("tsp", 2, {"attention_gqa": "fused"}, True), ("sp", 2, {"attention_gqa": "fused"}, False),
         ("ulysses", 2, {"attention_gqa": "fused"}, False)]


def _batch():
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, CFG.vocab_size, (len(LENGTHS), SEQ + 1), generator=gen)
    labels = tokens[:, 1:].clone()
    labels[1, :2] = -100
    return tokens[:, :-1].contiguous(), labels


def _positions(documents: bool) -> PositionRuns | None:
    return PositionRuns.contiguous(SEQ).with_documents(Documents.from_lengths(LENGTHS)) if documents else None


@functools.lru_cache(maxsize=None)
def _reference(documents: bool):
    """One process on the fused route: (loss sum, token count, gradients, logits)."""
    model = Transformer(CFG)
    init_model(model, SEED)
    ids, labels = _batch()
    with torch.no_grad():
        logits = model(ids, _positions(documents))
    if documents:
        return (*per_document_reference(model, ids, labels, LENGTHS, reset_positions=False), logits)
    loss_sum, count = model.loss_sum(ids, labels)
    (loss_sum / count).backward()
    return loss_sum.item(), int(count), {n: p.grad.clone() for n, p in model.named_parameters()}, logits


def _native_rank(rank, world, scheme, options, documents, ids, labels, logits):
    mesh = build_mesh(world)
    options = dict(options)
    model = Transformer(CFG, attention_gqa=options.pop("attention_gqa", "native"))
    init_model(model, SEED)
    if scheme == "ulysses":                      # its all-to-all attention, as the trainer builds it
        from tsp_trainer.engine.ulysses import distributed_attention

        options = {**options, "distributed_attention": distributed_attention}
    checkpointing = options.pop("checkpointing", False)
    par = parallelize(model, scheme, mesh, seq_len=ids.shape[1], **options)
    if checkpointing:
        model.block_wrapper = checkpointed_block
    docs = Documents.from_lengths(LENGTHS) if documents else None
    with native_gqa_route() as native:
        local_ids, local_labels, pos = par.local_batch(ids, labels, docs)
        loss_sum, count = par.loss_sum(local_ids, local_labels, pos)
        total = global_count(count, par.token_comms)
        (loss_sum / total).backward()
        with torch.no_grad():
            local_logits = par.model(local_ids, pos)
    expected = par.local_batch(logits, logits)[0]          # this rank's tokens of the reference's
    return {"loss_sum": reduce_loss_value(loss_sum, total, par.token_comms) * float(total),
            "count": int(total), "grads": par.gather_full_grads(), "native_calls": native["grouped"],
            "logits": local_logits, "expected_logits": expected}


RUNS = ForkedCases()


def _key(scheme, options, documents) -> tuple:
    return scheme, tuple(sorted(options.items())), documents


for _s, _w, _o, _d in CASES:
    RUNS.add(_w, _key(_s, _o, _d), _native_rank, _s, _o, _d, *_batch(), _reference(_d)[3])


@pytest.mark.parametrize("scheme,world,options,documents", CASES,
                         ids=[f"{s}-d{w}{'-' + '-'.join(f'{k}{v}' for k, v in o.items()) if o else ''}"
                              f"{'-documents' if d else ''}" for s, w, o, d in CASES])
def test_native_gqa_equals_one_process_on_the_fused_route(scheme, world, options, documents):
    ref_loss, ref_count, ref_grads, _ = _reference(documents)
    for rank, out in enumerate(RUNS.result(world, _key(scheme, options, documents))):
        if options.get("attention_gqa") == "fused":
            assert out["native_calls"] == 0, f"rank {rank} took the native path under attention_gqa=fused"
        else:
            assert out["native_calls"] > 0, f"rank {rank} never took the native path"
        torch.testing.assert_close(out["logits"], out["expected_logits"], **TOL,
                                   msg=lambda m: f"rank {rank} logits: {m}")
        assert out["count"] == ref_count
        assert out["loss_sum"] == pytest.approx(ref_loss, rel=1e-5), f"rank {rank} loss"
        for name, grad in ref_grads.items():
            torch.testing.assert_close(out["grads"][name], grad, **TOL,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
