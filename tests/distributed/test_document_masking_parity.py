"""Document masking under every scheme: the loss and every gradient of a packed batch with
masking equal the sum over its documents, each run alone on one process (fp32, rtol 1e-5 /
atol 1e-6), on 2 and 4 ranks for TSP (zigzag) and every baseline, with and without activation
checkpointing and reset_positions, the loss (and the MLP, and TSP's K/V) taken in one chunk of
tokens or in several.
Documents have lengths that are no multiple of 2D (one token, odd lengths, documents across
chunk and rank boundaries). One rank: tests/unit/test_document_masking.py."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.distributed.tsp_cases import init_model
from tests.helpers.dist import ForkedCases
from tests.unit.test_document_masking import per_document_reference
from tsp_trainer.config import ModelConfig
from tsp_trainer.model import Transformer
from tsp_trainer.model.activation_checkpoint import checkpointed_block
from tsp_trainer.model.documents import Documents
from tsp_trainer.parallel.loss import global_count, reduce_loss_value
from tsp_trainer.parallel.mesh import build_mesh
from tsp_trainer.parallel.schemes import parallelize

pytestmark = pytest.mark.distributed

SEED, SEQ = 11, 32
CFG = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=4,
                  intermediate_size=128, max_seq_len=64, qkv_bias=True, o_bias=True)
LENGTHS = [[5, 11, 1, 15], [3, 29]]
TOL = dict(rtol=1e-5, atol=1e-6)

# (scheme, world, options, activation checkpointing, reset_positions)
CASES = [("tsp", 2, {}, False, False), ("tsp", 2, {}, True, True), ("tsp", 4, {}, False, True),
         ("tsp", 4, {}, True, False), ("tsp", 2, {"head_buckets": 2}, False, False),
         ("tsp", 4, {"tsp_recompute": "selective"}, False, True),
         ("tsp", 2, {"tsp_recompute": "selective", "head_buckets": 2}, False, False),
         ("tsp", 2, {"tsp_recompute": "none", "head_buckets": 2}, True, True),
         ("tsp", 4, {"tsp_recompute": "selective"}, True, False),
         ("tp", 2, {}, True, False), ("tp", 4, {}, False, True),
         ("tp_sp", 2, {}, False, True), ("tp_sp", 4, {}, True, False),
         ("sp", 2, {}, True, True), ("sp", 4, {}, False, False), ("sp", 4, {}, True, True),
         ("tp_x_sp", 4, {"tp_degree": 2, "sp_degree": 2}, True, True),
         ("tp_x_sp", 4, {"tp_degree": 2, "sp_degree": 2, "tp_sequence_parallel": True}, False, False),
         # the loss in chunks of a few tokens (parallel.loss_chunk_tokens): chunk edges fall inside
         # documents and next to the ignored labels
         ("tsp", 2, {"loss_chunk_tokens": 5}, True, False), ("tsp", 4, {"loss_chunk_tokens": 3}, False, True),
         ("tp", 2, {"loss_chunk_tokens": 7}, False, True), ("tp_sp", 4, {"loss_chunk_tokens": 5}, True, False),
         ("sp", 4, {"loss_chunk_tokens": 3}, True, True),
         ("tp_x_sp", 4, {"tp_degree": 2, "sp_degree": 2, "loss_chunk_tokens": 5}, False, False),
         # the MLP in chunks of a few tokens (parallel.mlp_chunk_tokens), edges inside documents
         ("tsp", 2, {"mlp_chunk_tokens": 5}, False, True), ("tsp", 4, {"mlp_chunk_tokens": 3}, True, False),
         ("tsp", 2, {"mlp_chunk_tokens": 7, "tsp_recompute": "none"}, False, False),
         ("tp", 2, {"mlp_chunk_tokens": 7}, True, True), ("sp", 4, {"mlp_chunk_tokens": 3}, False, False),
         ("tp_x_sp", 4, {"tp_degree": 2, "sp_degree": 2, "mlp_chunk_tokens": 5}, True, False),
         # TSP's K/V in chunks of a few local tokens (parallel.attention_chunk_tokens): chunk edges
         # inside documents and across the zigzag halves (local 16 or 8 tokens, halves of 8 or 4)
         ("tsp", 2, {"attention_chunk_tokens": 5, "head_buckets": 2, "tsp_recompute": "selective"}, False, False),
         ("tsp", 4, {"attention_chunk_tokens": 3, "tsp_recompute": "none"}, True, True)]


def _batch():
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, CFG.vocab_size, (len(LENGTHS), SEQ + 1), generator=gen)
    labels = tokens[:, 1:].clone()
    labels[1, :2] = -100
    return tokens[:, :-1].contiguous(), labels


# Qwen3's per-head q/k norms with the layers tiled (each block norm's work handed to the attention
# and the MLP, parallel/tsp/norm.py), on 1, 2 and 4 ranks
QK_NORM_CASES = [("tsp", 1, {"mlp_chunk_tokens": 5}, False, True),
                 ("tsp", 2, {"mlp_chunk_tokens": 5}, True, False),
                 ("tsp", 4, {"mlp_chunk_tokens": 3, "tsp_recompute": "selective"}, False, True)]


def _cfg(qk_norm: bool) -> ModelConfig:
    return CFG.replace(family="qwen3", qk_norm=True) if qk_norm else CFG


@functools.lru_cache(maxsize=None)
def _reference(reset_positions: bool, qk_norm: bool = False):
    model = Transformer(_cfg(qk_norm))
    init_model(model, SEED)
    ids, labels = _batch()
    return per_document_reference(model, ids, labels, LENGTHS, reset_positions=reset_positions)


def _masked_rank(rank, world, scheme, options, checkpointing, reset_positions, ids, labels, qk_norm=False):
    mesh = build_mesh(world)
    model = Transformer(_cfg(qk_norm))
    init_model(model, SEED)
    par = parallelize(model, scheme, mesh, seq_len=ids.shape[1], **options)
    if checkpointing:
        model.block_wrapper = checkpointed_block
    docs = Documents.from_lengths(LENGTHS, reset_positions=reset_positions)
    local_ids, local_labels, pos = par.local_batch(ids, labels, docs)
    loss_sum, count = par.loss_sum(local_ids, local_labels, pos)
    total = global_count(count, par.token_comms)
    (loss_sum / total).backward()
    return {"loss_sum": reduce_loss_value(loss_sum, total, par.token_comms) * float(total),
            "count": int(total), "grads": par.gather_full_grads()}


# Every case's ranks run in a fork shared with the next cases of its world size (ForkedCases).
RUNS = ForkedCases()


def _key(scheme, options, checkpointing, reset_positions, qk_norm=False) -> tuple:
    return scheme, tuple(sorted(options.items())), checkpointing, reset_positions, qk_norm


for _s, _w, _o, _ac, _r in CASES:
    RUNS.add(_w, _key(_s, _o, _ac, _r), _masked_rank, _s, _o, _ac, _r, *_batch())
for _s, _w, _o, _ac, _r in QK_NORM_CASES:
    RUNS.add(_w, _key(_s, _o, _ac, _r, True), _masked_rank, _s, _o, _ac, _r, *_batch(), True)


@pytest.mark.parametrize("scheme,world,options,checkpointing,reset_positions", CASES,
                         ids=[f"{s}-d{w}{'-' + '-'.join(f'{k}{v}' for k, v in o.items()) if o else ''}"
                              f"{'-ac' if ac else ''}{'-reset' if r else ''}" for s, w, o, ac, r in CASES])
def test_packed_documents_equal_documents_alone(scheme, world, options, checkpointing, reset_positions):
    _assert_equal_to_reference(RUNS.result(world, _key(scheme, options, checkpointing, reset_positions)),
                               *_reference(reset_positions))


@pytest.mark.parametrize("scheme,world,options,checkpointing,reset_positions", QK_NORM_CASES,
                         ids=[f"{s}-d{w}-{'-'.join(f'{k}{v}' for k, v in o.items())}"
                              f"{'-ac' if ac else ''}{'-reset' if r else ''}" for s, w, o, ac, r in QK_NORM_CASES])
def test_packed_documents_with_qk_norms_equal_documents_alone(scheme, world, options, checkpointing,
                                                               reset_positions):
    ref_loss, ref_count, ref_grads = _reference(reset_positions, True)
    assert any("q_norm" in name for name in ref_grads)
    _assert_equal_to_reference(RUNS.result(world, _key(scheme, options, checkpointing, reset_positions, True)),
                               ref_loss, ref_count, ref_grads)


def _assert_equal_to_reference(results, ref_loss, ref_count, ref_grads) -> None:
    """Every rank's token count, loss and every gradient equal the one-process reference's."""
    for rank, out in enumerate(results):
        assert out["count"] == ref_count
        assert out["loss_sum"] == pytest.approx(ref_loss, rel=1e-5), f"rank {rank} loss"
        for name, grad in ref_grads.items():
            torch.testing.assert_close(out["grads"][name], grad, **TOL,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
