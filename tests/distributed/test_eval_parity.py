"""Evaluation under the training layout equals one process: per-token losses and argmax (in each
rank's layout, at its global positions), the loss-by-position buckets summed over the model-parallel
and DP groups, and the passkey predictions, for TSP at D = 2 and 4 and every baseline. fp32,
rtol 1e-5 / atol 1e-6 (the same math, summed in another order); argmax and predictions exactly.
No rank ever holds full-vocabulary logits of all tokens (under TSP: no tensor with a vocabulary-
sized dim at all)."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.distributed.eval_cases import eval_rank, reference_passkey, reference_stats
from tests.distributed.tsp_cases import make_batch
from tests.helpers.dist import ForkedCases
from tsp_trainer.config import ModelConfig
from tsp_trainer.config.model import RopeScaling
from tsp_trainer.data import load_tokenizer
from tsp_trainer.eval import HaystackBuilder, PasskeyTask, bucket_edges

pytestmark = pytest.mark.distributed
TOL = dict(rtol=1e-5, atol=1e-6)
BATCH, SEQ = 4, 128

# GQA with every bias kind and a scaled RoPE whose original context (16) is far below the positions.
CFG = ModelConfig(vocab_size=1280, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=4,
                  intermediate_size=128, max_seq_len=256, qkv_bias=True, o_bias=True, mlp_bias=True,
                  rope_scaling=RopeScaling("llama3", factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=16))

CASES = [  # (scheme, world, dp, options)
    ("tsp", 2, 1, {}), ("tsp", 4, 1, {}), ("tsp", 4, 2, {}),
    ("tp", 2, 1, {}), ("tp_sp", 2, 1, {}), ("sp", 2, 1, {}), ("sp", 4, 1, {}),
    ("tp_x_sp", 4, 1, {"tp_degree": 2, "sp_degree": 2, "tp_sequence_parallel": True}),
    # the head's tokens in chunks of 80 (parallel.loss_chunk_tokens; 256 or 512 local tokens)
    ("tsp", 2, 1, {"loss_chunk_tokens": 80}), ("tp", 2, 1, {"loss_chunk_tokens": 80}),
    ("sp", 2, 1, {"loss_chunk_tokens": 80}),
]


@functools.lru_cache(maxsize=None)
def _task() -> PasskeyTask:
    builder = HaystackBuilder(load_tokenizer("data/tokenizer"), list(range(100, 900)), digits=4, seed=3)
    return PasskeyTask(lengths=(112, 128), depths=(0.0, 0.5, 1.0), samples=2, builder=builder)


@functools.lru_cache(maxsize=None)
def _reference():
    ids, labels = make_batch(CFG, BATCH, SEQ)
    loss, argmax = reference_stats(CFG, ids, labels)
    return ids, labels, loss, argmax, reference_passkey(CFG, _task())


def _expected_buckets(loss, labels):
    edges = bucket_edges(SEQ)
    valid = labels != -100
    sums = [float(loss[:, a:b][valid[:, a:b]].double().sum()) for a, b in zip(edges, edges[1:])]
    tokens = [int(valid[:, a:b].sum()) for a, b in zip(edges, edges[1:])]
    return sums, tokens


# Every case's ranks run in a fork shared with the next cases of its world size (ForkedCases).
RUNS = ForkedCases()
for _s, _w, _dp, _o in CASES:
    RUNS.add(_w, (_s, _dp, tuple(sorted(_o.items()))), eval_rank, CFG, _s, _o, *_reference()[:2], _task(), _dp)


@pytest.mark.parametrize("scheme,world,dp,options", CASES,
                         ids=[f"{s}-w{w}-dp{d}" + ("-" + "x".join(map(str, o.values())) if o else "")
                              for s, w, d, o in CASES])
def test_eval_under_every_layout_equals_one_process(scheme, world, dp, options):
    _, labels, ref_loss, ref_argmax, ref_passkey = _reference()
    outs = RUNS.result(world, (scheme, dp, tuple(sorted(options.items()))))

    # per-token stats: each rank's tokens, at their global positions, equal the reference
    covered = torch.zeros(BATCH, SEQ, dtype=torch.long)
    for rank, o in enumerate(outs):
        rows = slice(o["dp_rank"], None, dp)
        pos = o["positions"]
        torch.testing.assert_close(o["loss"], ref_loss[rows][:, pos], **TOL,
                                   msg=lambda m: f"rank {rank} loss: {m}")
        assert torch.equal(o["argmax"], ref_argmax[rows][:, pos]), f"rank {rank} argmax"
        covered[rows, pos] += 1
    assert covered.min() >= 1                         # every token was scored somewhere

    # buckets: summed over the token-splitting groups and dp, each token counted once
    sums, tokens = _expected_buckets(ref_loss, labels)
    for o in outs:
        b = o["buckets"]
        assert list(b.tokens) == tokens
        torch.testing.assert_close(torch.tensor(b.loss_sums, dtype=torch.float64), torch.tensor(sums, dtype=torch.float64),
                                   rtol=1e-5, atol=1e-5)
        valid = labels != -100
        assert b.mean_loss == pytest.approx(float(ref_loss[valid].double().mean()), rel=1e-6)

    # passkey: the predicted key tokens equal the single process's argmax, sample by sample
    seen = {}
    for o in outs:
        seen.update(o["passkey"].predictions)
    assert seen == ref_passkey
    task = _task()
    for o in outs:                                   # every rank has the same, dp-summed cells
        for cell in o["passkey"].cells:
            keys = [task.builder.build(cell.length, cell.depth, s).key_ids for s in range(task.samples)]
            preds = [ref_passkey[(cell.length, cell.depth, s)] for s in range(task.samples)]
            assert cell.samples == task.samples
            assert cell.exact == sum(list(k) == p for k, p in zip(keys, preds))
            assert cell.tokens_right == sum(a == b for k, p in zip(keys, preds) for a, b in zip(k, p))

    # memory: no tensor the size of the full logits of all local tokens, let alone all tokens;
    # TSP never has a vocabulary-sized dim (its head works on [N/D, V/D] blocks)
    tokens_here = BATCH // dp * SEQ
    for o in outs:
        biggest = max(torch.Size(s).numel() for s in o["shapes"])
        assert biggest < tokens_here * CFG.vocab_size
        if scheme == "tsp":
            assert not [s for s in o["shapes"] if CFG.vocab_size in s]
        if "loss_chunk_tokens" in options:            # logits [chunk, V/T]: never more rows
            rows = CFG.vocab_size // (1 if scheme == "sp" else world)
            chunk = options["loss_chunk_tokens"]
            assert [s for s in o["shapes"] if s[-1:] == (rows,) and torch.Size(s[:-1]).numel() == chunk]
            assert not [s for s in o["shapes"] if s[-1:] == (rows,) and torch.Size(s[:-1]).numel() > chunk]
