"""Evaluation attends as training does under data.document_masking: the Trainer's Evaluator hands
every held-out batch to local_batch with its documents, so the packed eval loss equals the sum of
each document's loss, each document run alone on one process with the same weights (fp32, rel
1e-5), on 1, 2 and 4 gloo ranks (TSP zigzag, SP, TSP x DP). The loss by position buckets by the
position inside the document under reset_positions, by the position in the row otherwise. The
passkey runs under the same masking: one document per haystack, predictions as one process."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.distributed.eval_cases import (masked_eval_rank, per_document_buckets,
                                          reference_passkey)
from tests.helpers.dist import run_on_ranks
from tsp_trainer.config import ModelConfig
from tsp_trainer.data import load_tokenizer
from tsp_trainer.eval import HaystackBuilder, PasskeyTask
from tsp_trainer.model.documents import Documents

pytestmark = pytest.mark.distributed

SEQ = 32
CFG = ModelConfig(vocab_size=1280, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=4,
                  intermediate_size=128, max_seq_len=256, qkv_bias=True, o_bias=True)
# Documents across chunk and rank boundaries, one token long, no multiple of 2D.
LENGTHS = [[5, 11, 1, 15], [3, 29], [32], [7, 7, 9, 9]]

CASES = [  # (scheme, world, dp, reset_positions)
    ("tsp", 1, 1, False), ("tsp", 1, 1, True), ("tsp", 2, 1, False), ("tsp", 2, 1, True),
    ("sp", 2, 1, True), ("tsp", 4, 1, True), ("tsp", 4, 2, False), ("sp", 4, 1, False),
]


@functools.lru_cache(maxsize=None)
def _batches():
    """Two micro-batches of two rows each, as the held-out loader gives them (document_ids)."""
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, CFG.vocab_size, (len(LENGTHS), SEQ + 1), generator=gen)
    ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].clone()
    labels[1, :2] = -100
    doc_ids = torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in LENGTHS],
                           dtype=torch.int32)
    batches = tuple({"input_ids": ids[i:i + 2], "labels": labels[i:i + 2], "document_ids": doc_ids[i:i + 2]}
                    for i in (0, 2))
    return ids, labels, batches


@functools.lru_cache(maxsize=None)
def _task() -> PasskeyTask:
    builder = HaystackBuilder(load_tokenizer("data/tokenizer"), list(range(100, 900)), digits=4, seed=3)
    return PasskeyTask(lengths=(112, 128), depths=(0.0, 1.0), samples=2, builder=builder)


@pytest.mark.parametrize("scheme,world,dp,reset_positions", CASES,
                         ids=[f"{s}-w{w}-dp{d}{'-reset' if r else ''}" for s, w, d, r in CASES])
def test_packed_eval_loss_with_masking_equals_documents_alone(scheme, world, dp, reset_positions):
    ids, labels, batches = _batches()
    # the Evaluator's DP rank r takes rows r, r + dp, ... of each micro-batch: same documents overall
    sums, tokens = per_document_buckets(CFG, ids, labels, LENGTHS, reset_positions=reset_positions,
                                        seq_len=SEQ)
    outs = run_on_ranks(masked_eval_rank, world, CFG, scheme, list(batches), reset_positions, _task(), dp)
    for rank, o in enumerate(outs):
        b = o["buckets"]
        assert list(b.tokens) == tokens, f"rank {rank}"
        torch.testing.assert_close(torch.tensor(b.loss_sums, dtype=torch.float64),
                                   torch.tensor(sums, dtype=torch.float64), rtol=1e-5, atol=1e-5)
        assert b.mean_loss == pytest.approx(sum(sums) / sum(tokens), rel=1e-5)

    # passkey: a haystack holds no EOS, so each is one document, and the predictions are the
    # single process's (which attends over the whole haystack)
    seen = {}
    for o in outs:
        seen.update(o["passkey"].predictions)
        assert o["documents"], "run_passkey called local_batch without documents"
        for docs in o["documents"]:
            assert isinstance(docs, Documents) and docs.reset_positions == reset_positions
            assert set(docs.starts) == {(0,)}
    assert seen == _reference_passkey()


@functools.lru_cache(maxsize=None)
def _reference_passkey():
    return reference_passkey(CFG, _task())


def test_reset_positions_moves_tokens_into_document_buckets():
    """The two bucketings differ on this batch (so the test above tells them apart): bucket [0]
    holds every document's first token under reset_positions, each row's first token otherwise."""
    ids, labels, _ = _batches()
    _, by_row = per_document_buckets(CFG, ids, labels, LENGTHS, reset_positions=False, seq_len=SEQ)
    _, by_doc = per_document_buckets(CFG, ids, labels, LENGTHS, reset_positions=True, seq_len=SEQ)
    assert by_row[0] == 3                    # row position 0 of the 4 rows, one label ignored
    assert by_doc[0] == 10                   # the first token of each of the 11 documents, less one
    assert sum(by_row) == sum(by_doc)
