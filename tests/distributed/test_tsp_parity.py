"""TSP against one process: same full weights, same batch, fp32. Logits, loss and every parameter
gradient (gathered back to full shape) must match; so must the weights after 3 AdamW steps.

Tolerance: rtol 1e-5 / atol 1e-6 as the project requires. The computations differ only in the order
of fp32 summations (per-shard partial sums; each zigzag chunk's key prefix and diagonal block
merged by log-sum-exp)."""

import pytest
import torch

from tests.distributed.tsp_cases import largest_gathered_kv, make_batch, reference, tsp_rank
from tests.helpers.dist import ForkedCases
from tsp_trainer.config import model_config
from tsp_trainer.config.model import RopeScaling
from tsp_trainer.parallel import zigzag
from tsp_trainer.parallel.tsp.comm_model import ledger_totals, tsp_step_comm

pytestmark = pytest.mark.distributed
RTOL, ATOL = 1e-5, 1e-6
# Every case's ranks run in a fork shared with the next cases of its degree (ForkedCases), eleven
# to a fork (40 cases on 2 ranks and 33 on 4: four and three forks).
RUNS = ForkedCases(per_fork=11)


def _assert_parity(ref, outs):
    logits = zigzag.unshard_sequence([o["logits_local"] for o in outs])
    torch.testing.assert_close(logits, ref["logits"], rtol=RTOL, atol=ATOL)
    for o in outs:
        assert o["loss"] == pytest.approx(ref["loss"], rel=RTOL, abs=ATOL)
    for name, g in ref["grads"].items():
        for rank, o in enumerate(outs):
            torch.testing.assert_close(o["grads"][name], g, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"rank {rank} grad {name}: {m}")


def _plain(kv_heads, seq_len, **extra):
    cfg = model_config("tiny", num_heads=8, num_kv_heads=kv_heads, **extra)
    return (cfg, *make_batch(cfg, 2, seq_len))


PLAIN_CASES = [(1, 4, 1, 16), (2, 4, 1, 16), (2, 2, 1, 24), (2, 4, 2, 32), (2, 2, 1, 8),
               (4, 4, 1, 16), (4, 4, 1, 40), (4, 8, 2, 48)]
for _d, _kv, _b, _t in PLAIN_CASES:
    _cfg, _ids, _labels = _plain(_kv, _t)
    RUNS.add(_d, ("plain", _kv, _b, _t), tsp_rank, _cfg, 7, _ids, _labels, _b)


@pytest.mark.parametrize("degree,kv_heads,buckets,seq_len", PLAIN_CASES)
def test_tsp_matches_single_process(degree, kv_heads, buckets, seq_len):
    cfg, ids, labels = _plain(kv_heads, seq_len)
    ref = reference(cfg, 7, ids, labels)
    outs = RUNS.result(degree, ("plain", kv_heads, buckets, seq_len))
    _assert_parity(ref, outs)


# Families as data: Llama attention_bias + mlp_bias (sharded q/k/v, gate/up biases travel in the
# packed shards; replicated o/down biases summed over the group) and Qwen2 (q/k/v biases only),
# each with a scaled RoPE whose original context (8) is far below the positions used (up to 47).
FAMILY_CFGS = {
    "llama_bias_llama3": dict(qkv_bias=True, o_bias=True, mlp_bias=True, rope_theta=500000.0,
                              rope_scaling=RopeScaling("llama3", factor=8.0, low_freq_factor=1.0,
                                                       high_freq_factor=4.0,
                                                       original_max_position_embeddings=8)),
    "qwen2_yarn": dict(family="qwen2", qkv_bias=True, rope_theta=1e6,
                       rope_scaling=RopeScaling("yarn", factor=4.0, original_max_position_embeddings=8)),
    "mistral_linear": dict(family="mistral", rope_scaling=RopeScaling("linear", factor=2.0)),
}


FAMILY_SHAPES = [(2, 2, 32), (4, 1, 48)]
for _f in sorted(FAMILY_CFGS):
    for _d, _b, _t in FAMILY_SHAPES:
        _cfg, _ids, _labels = _plain(4, _t, **FAMILY_CFGS[_f])
        RUNS.add(_d, ("family", _f, _b, _t), tsp_rank, _cfg, 7, _ids, _labels, _b)


@pytest.mark.parametrize("family", sorted(FAMILY_CFGS))
@pytest.mark.parametrize("degree,buckets,seq_len", FAMILY_SHAPES)
def test_tsp_families_biases_and_scaled_rope(family, degree, buckets, seq_len):
    cfg, ids, labels = _plain(4, seq_len, **FAMILY_CFGS[family])
    ref = reference(cfg, 7, ids, labels)
    assert any(n.endswith(".bias") for n in ref["grads"]) or family == "mistral_linear"
    outs = RUNS.result(degree, ("family", family, buckets, seq_len))
    _assert_parity(ref, outs)
    expected = tsp_step_comm(cfg, degree=degree, batch=2, seq_len=seq_len, head_buckets=buckets)
    for o in outs:
        assert ledger_totals(o["ledger"]) == expected


SELECTIVE_CASES = [
    (1, 4, 1, 16, None, "selective"), (2, 4, 2, 32, None, "selective"),
    (2, 2, 1, 24, "qwen2_yarn", "selective"), (4, 4, 1, 40, "llama_bias_llama3", "selective"),
    (4, 8, 2, 48, None, "selective"),
    (1, 4, 1, 16, None, "none"), (2, 4, 2, 32, "qwen2_yarn", "none"),
    (4, 4, 1, 40, "llama_bias_llama3", "none"),
]
for _d, _kv, _b, _t, _f, _m in SELECTIVE_CASES:
    _cfg, _ids, _labels = _plain(_kv, _t, **FAMILY_CFGS.get(_f, {}))
    RUNS.add(_d, ("recompute", _kv, _b, _t, _f, _m), tsp_rank, _cfg, 7, _ids, _labels, _b, 2, 1e-2,
             False, "sgd", _m)


@pytest.mark.parametrize("degree,kv_heads,buckets,seq_len,family,mode", SELECTIVE_CASES)
def test_selective_recompute_matches_single_process(degree, kv_heads, buckets, seq_len, family, mode):
    """parallel.tsp_recompute=selective (attention output and K/V views kept from forward, K/V
    re-gathered) and none (also the MLP's gate/up pre-activations kept: no recompute) give the same
    logits, loss, gradients and, after two SGD steps, weights; they move exactly the bytes of full
    recompute (backward re-gathers K/V in all three; the MLP's ring is the same)."""
    cfg, ids, labels = _plain(kv_heads, seq_len, **FAMILY_CFGS.get(family, {}))
    ref = reference(cfg, 7, ids, labels, steps=2, optim="sgd")
    outs = RUNS.result(degree, ("recompute", kv_heads, buckets, seq_len, family, mode))
    _assert_parity(ref, outs)
    expected = tsp_step_comm(cfg, degree=degree, batch=2, seq_len=seq_len, head_buckets=buckets)
    for o in outs:
        assert ledger_totals(o["ledger"]) == expected
        for name, w in ref["weights"].items():
            torch.testing.assert_close(o["weights"][name], w, rtol=RTOL, atol=ATOL, msg=name)


CHECKPOINT_CASES = [
    (1, 4, 1, 16, None, "full", "all"), (2, 4, 2, 32, "llama_bias_llama3", "full", "all"),
    (4, 8, 2, 48, None, "selective", "all"), (2, 2, 1, 24, "qwen2_yarn", "selective", "all"),
    (4, 4, 1, 40, "llama_bias_llama3", "none", "all"),
    (1, 4, 1, 16, None, "full", "attention"), (2, 4, 2, 32, "llama_bias_llama3", "full", "attention"),
    (4, 8, 2, 48, None, "full", "attention"),
    (1, 4, 1, 16, None, "full", "nothing"), (2, 2, 1, 24, "qwen2_yarn", "full", "nothing"),
    (4, 4, 1, 40, "llama_bias_llama3", "full", "nothing"),
]
for _d, _kv, _b, _t, _f, _m, _k in CHECKPOINT_CASES:
    _cfg, _ids, _labels = _plain(_kv, _t, **FAMILY_CFGS.get(_f, {}))
    RUNS.add(_d, ("checkpointing", _kv, _b, _t, _f, _m, _k), tsp_rank, _cfg, 7, _ids, _labels, _b, 2,
             1e-2, False, "sgd", _m, "auto", True, "auto", False, _k)


@pytest.mark.parametrize("degree,kv_heads,buckets,seq_len,family,mode,keeps", CHECKPOINT_CASES)
def test_activation_checkpointing_matches_single_process(degree, kv_heads, buckets, seq_len, family,
                                                          mode, keeps):
    """Under activation checkpointing the block's replay hands what parallel.checkpoint_replay_keeps
    lets it keep to the block's backward (all: attention items and gate/up pre-activations, in every
    tsp_recompute mode; attention: the items, the MLP recomputing gate/up; nothing: both recomputed):
    the same logits, loss, gradients and, after two SGD steps (each a forward + backward through the
    replay; the logits forward with grad is never backpropagated, so its blocks never replay),
    weights."""
    cfg, ids, labels = _plain(kv_heads, seq_len, **FAMILY_CFGS.get(family, {}))
    ref = reference(cfg, 7, ids, labels, steps=2, optim="sgd")
    outs = RUNS.result(degree, ("checkpointing", kv_heads, buckets, seq_len, family, mode, keeps))
    _assert_parity(ref, outs)
    for o in outs:
        for name, w in ref["weights"].items():
            torch.testing.assert_close(o["weights"][name], w, rtol=RTOL, atol=ATOL, msg=name)


# parallel.attention_chunk_tokens: each item's K/V gathered, and its dK/dV reduce-scattered, in
# chunks of that many local tokens; chunks that do not divide the local tokens (or their zigzag
# halves), one token, GQA, head buckets, biases, full and selective recompute, activation
# checkpointing (none, and document masking: tests/distributed/test_document_masking_parity.py)
CHUNKED_CASES = [
    (1, 4, 1, 16, 3, None, "full", False), (2, 4, 2, 32, 5, "qwen2_yarn", "selective", False),
    (2, 4, 1, 16, 1, None, "full", True), (4, 4, 1, 40, 3, "llama_bias_llama3", "full", False),
]
for _d, _kv, _b, _t, _c, _f, _m, _ac in CHUNKED_CASES:
    _cfg, _ids, _labels = _plain(_kv, _t, **FAMILY_CFGS.get(_f, {}))
    RUNS.add(_d, ("chunked", _kv, _b, _t, _c, _f, _m, _ac), tsp_rank, _cfg, 7, _ids, _labels, _b, 0, 1e-2,
             False, "sgd", _m, "auto", _ac, "auto", False, "all", _c)


@pytest.mark.parametrize("degree,kv_heads,buckets,seq_len,chunk,family,mode,checkpointing", CHUNKED_CASES)
def test_chunked_attention_matches_single_process(degree, kv_heads, buckets, seq_len, chunk, family, mode,
                                                  checkpointing):
    """Logits, loss and every gradient equal one process's. Without checkpointing, selective and
    none move the unchunked path's bytes (each chunk is gathered once in forward and once in
    backward, each chunk's dK/dV reduce-scattered once), in more calls; full recompute re-gathers
    every chunk twice in backward (the chunked forward for out and lse, then the backward)."""
    cfg, ids, labels = _plain(kv_heads, seq_len, **FAMILY_CFGS.get(family, {}))
    ref = reference(cfg, 7, ids, labels)
    outs = RUNS.result(degree, ("chunked", kv_heads, buckets, seq_len, chunk, family, mode, checkpointing))
    _assert_parity(ref, outs)
    expected = tsp_step_comm(cfg, degree=degree, batch=2, seq_len=seq_len, head_buckets=buckets)
    chunks = -(-(seq_len // degree) // chunk)
    for o in outs:
        totals = ledger_totals(o["ledger"])
        gathers = sum(1 for r in o["ledger"] if r.tag == "attn.kv")
        if degree > 1 and mode != "full":
            assert {k: v["bytes"] for k, v in totals.items()} == {k: v["bytes"] for k, v in expected.items()}
        if degree > 1:
            passes = 2 if mode != "full" else 3
            assert gathers == passes * chunks * buckets * degree * cfg.num_layers


for _c in ("auto", 8):
    RUNS.add(2, ("largest_kv", _c), largest_gathered_kv, 64, _c)


def test_chunked_attention_never_holds_the_sequence_kv():
    """The largest K/V- or dK/dV-shaped tensor a block creates beyond the rank's own tokens' is the
    whole sequence's [D, B, S/D, 2, H, d] gather unchunked, one chunk's [D, B, c, 2, H, d] in chunks."""
    assert RUNS.result(2, ("largest_kv", "auto"))[0] == (2, 32, 2, 2, 8)
    assert RUNS.result(2, ("largest_kv", 8))[0] == (2, 8, 2, 2, 8)


def _gqa():
    cfg = model_config("tiny", num_heads=8, num_kv_heads=4, hidden_size=64)
    return (cfg, *make_batch(cfg, 1, 32))


def _tied():
    cfg = model_config("tiny", tie_embeddings=True)
    return (cfg, *make_batch(cfg, 2, 16))


_cfg, _ids, _labels = _gqa()
RUNS.add(4, "gqa", tsp_rank, _cfg, 3, _ids, _labels, 1)
_cfg, _ids, _labels = _tied()
RUNS.add(2, "tied_meta", tsp_rank, _cfg, 11, _ids, _labels, 1, 0, 1e-2, True)


def test_tsp_gqa_on_four_ranks():
    cfg, ids, labels = _gqa()
    ref = reference(cfg, 3, ids, labels)
    _assert_parity(ref, RUNS.result(4, "gqa"))


def test_tsp_tied_embeddings_and_meta_init():
    """Shards initialised on the meta device from the seed equal slices of the plain init; tied
    embedding/head share one vocab shard and get both gradients."""
    cfg, ids, labels = _tied()
    ref = reference(cfg, 11, ids, labels)
    outs = RUNS.result(2, "tied_meta")
    _assert_parity(ref, outs)


def _steps_batch():
    cfg = model_config("tiny")
    return (cfg, *make_batch(cfg, 2, 16))


_cfg, _ids, _labels = _steps_batch()
for _o in ("sgd", "adamw"):
    RUNS.add(2, ("steps", _o), tsp_rank, _cfg, 5, _ids, _labels, 1, 3, 1e-2, False, _o)


@pytest.mark.parametrize("optim,atol", [
    ("sgd", ATOL),
    # AdamW with tsp_cases.ADAMW_EPS: 3 steps * lr 1e-2 * 1e-7 / 1e-3 = 3e-6 (measured <= 7e-7 across
    # ATEN_CPU_CAPABILITY default, avx2 and avx512). A wrong shard of m or v moves weights by ~lr.
    ("adamw", 3e-6),
])
def test_three_optimizer_steps_match(optim, atol):
    cfg, ids, labels = _steps_batch()
    ref = reference(cfg, 5, ids, labels, steps=3, optim=optim)
    outs = RUNS.result(2, ("steps", optim))
    for name, w in ref["weights"].items():
        for o in outs:
            torch.testing.assert_close(o["weights"][name], w, rtol=RTOL, atol=atol, msg=name)


LEDGER_CASES = [(2, 1), (2, 2), (4, 1)]
_cfg, _ids, _labels = _plain(4, 32)
for _d, _b in LEDGER_CASES:
    RUNS.add(_d, ("ledger", _b), tsp_rank, _cfg, 1, _ids, _labels, _b)


@pytest.mark.parametrize("degree,buckets", LEDGER_CASES)
def test_ledger_equals_closed_form(degree, buckets):
    cfg = model_config("tiny", num_heads=8, num_kv_heads=4)
    outs = RUNS.result(degree, ("ledger", buckets))
    expected = tsp_step_comm(cfg, degree=degree, batch=2, seq_len=32, head_buckets=buckets)
    for o in outs:
        assert ledger_totals(o["ledger"]) == expected
    # no all-reduce anywhere in attention or MLP
    assert all(not (r.op == "all_reduce" and r.tag.split(".")[0] in ("attn", "mlp"))
               for r in outs[0]["ledger"])


def _bytes_case(biases):
    cfg = model_config("tiny", num_heads=8, num_kv_heads=4, qkv_bias=biases, o_bias=biases,
                       mlp_bias=biases)
    return (cfg, *make_batch(cfg, 1, 16))


BYTES_CASES = [(2, False), (4, False), (2, True)]
for _d, _bias in BYTES_CASES:
    _cfg, _ids, _labels = _bytes_case(_bias)
    RUNS.add(_d, ("bytes", _bias), tsp_rank, _cfg, 1, _ids, _labels, 1)


@pytest.mark.parametrize("degree,biases", BYTES_CASES)
def test_per_rank_parameter_bytes(degree, biases):
    cfg = _bytes_case(biases)[0]
    outs = RUNS.result(degree, ("bytes", biases))
    replicated = (2 * cfg.num_layers + 1) * cfg.hidden_size + cfg.num_layers * cfg.replicated_biases
    expected = ((cfg.num_params() - replicated) // degree + replicated) * 4
    assert all(o["param_bytes"] == expected for o in outs)


# (degree, tied head, activation checkpointing, tokens per loss chunk, vocabulary): 2 x 24 tokens
# give 48 / D local tokens, so 5 takes them in 10, 5 and 3 chunks (the last one shorter); a
# vocabulary of 1,031 rows is padded to a multiple of D (the padding rows' logits masked).
TILED_CASES = [(1, False, False, 5, 1024), (2, False, True, 5, 1024), (2, True, False, 5, 1024),
               (4, False, False, 5, 1024), (4, True, True, 5, 1024), (2, False, False, 1, 1024),
               (2, True, False, 5, 1031), (4, False, False, 3, 1031)]


def _tiled(**extra):
    cfg = model_config("tiny", num_heads=8, num_kv_heads=4, **extra)
    return (cfg, *make_batch(cfg, 2, 24))


for _d, _tied_head, _ac, _c, _v in TILED_CASES:
    _cfg, _ids, _labels = _tiled(tie_embeddings=_tied_head, vocab_size=_v)
    RUNS.add(_d, ("tiled_loss", _tied_head, _ac, _c, _v), tsp_rank, _cfg, 7, _ids, _labels, 1, 0, 1e-2,
             False, "adamw", "full", _c, _ac)


@pytest.mark.parametrize("degree,tied,checkpointing,chunk,vocab", TILED_CASES,
                         ids=[f"d{d}{'-tied' if t else ''}{'-ac' if ac else ''}-chunk{c}-v{v}"
                              for d, t, ac, c, v in TILED_CASES])
def test_tiled_loss_matches_single_process(degree, tied, checkpointing, chunk, vocab):
    """parallel.loss_chunk_tokens forcing several chunks: the same loss and gradients as one
    process, and the vocab ring moves exactly what one chunk moves (each weight shard serves every
    chunk before it travels on): D - 1 head weight hops forward, D - 1 weight and D accumulator
    hops backward. (Activation checkpointing re-runs the blocks' forward, and their traffic, in
    backward: the head's and embedding's are still exactly the closed form.)"""
    cfg, ids, labels = _tiled(tie_embeddings=tied, vocab_size=vocab)
    ref = reference(cfg, 7, ids, labels)
    outs = RUNS.result(degree, ("tiled_loss", tied, checkpointing, chunk, vocab))
    _assert_parity(ref, outs)
    expected = tsp_step_comm(cfg, degree=degree, batch=2, seq_len=24, head_buckets=1)
    for o in outs:
        assert o["loss_chunk"] == chunk
        totals = ledger_totals(o["ledger"])
        if checkpointing:
            assert _vocab_traffic(totals) == _vocab_traffic(expected)
        else:
            assert totals == expected
        hops = {tag: totals.get(("send", tag), {"count": 0})["count"]
                for tag in ("head.weights", "head.weights.grad")}
        assert hops == {"head.weights": 2 * (degree - 1),
                        "head.weights.grad": degree if degree > 1 else 0}, hops


def _vocab_traffic(totals: dict) -> dict:
    """The ledger entries of the embedding and the LM head ((op, tag) -> count and bytes)."""
    return {k: v for k, v in totals.items() if k[1].split(".")[0] in ("head", "embed")}


# (degree, family, tsp_recompute, activation checkpointing, offload, tokens per MLP chunk):
# 2 x 24 tokens give 48 / D local tokens, so 5 takes them in 10, 5 and 3 chunks (the last
# shorter); 7 in 7 and 4 on 1 and 2 ranks, 2 on 4.
TILED_MLP_CASES = [(1, "llama_bias_llama3", "full", False, False, 5),
                   (2, None, "full", False, False, 5), (2, "qwen2_yarn", "full", True, False, 7),
                   (2, "llama_bias_llama3", "none", False, False, 5),
                   (2, "llama_bias_llama3", "full", True, True, 5),
                   (4, "llama_bias_llama3", "full", False, True, 5),
                   (4, None, "none", True, False, 5), (4, "qwen2_yarn", "selective", False, False, 7)]
for _d, _f, _m, _ac, _off, _c in TILED_MLP_CASES:
    _cfg, _ids, _labels = _tiled(**FAMILY_CFGS.get(_f, {}))
    RUNS.add(_d, ("tiled_mlp", _f, _m, _ac, _off, _c), tsp_rank, _cfg, 7, _ids, _labels, 1, 0, 1e-2,
             False, "adamw", _m, "auto", _ac, _c, _off)


@pytest.mark.parametrize("degree,family,mode,checkpointing,offload,chunk", TILED_MLP_CASES,
                         ids=[f"d{d}-{f or 'plain'}-{m}{'-ac' if ac else ''}{'-offload' if o else ''}"
                              f"-chunk{c}" for d, f, m, ac, o, c in TILED_MLP_CASES])
def test_tiled_mlp_matches_single_process(degree, family, mode, checkpointing, offload, chunk):
    """parallel.mlp_chunk_tokens forcing several chunks within each ring step (and the layers'
    accumulators in the activation dtype, fp32 here): the same logits, loss and gradients as one
    process, and every ring moves exactly the closed form's bytes, the MLP ring's D - 1 weight and
    D accumulator hops included (each shard serves every chunk before it travels on)."""
    cfg, ids, labels = _tiled(**FAMILY_CFGS.get(family, {}))
    ref = reference(cfg, 7, ids, labels)
    outs = RUNS.result(degree, ("tiled_mlp", family, mode, checkpointing, offload, chunk))
    _assert_parity(ref, outs)
    expected = tsp_step_comm(cfg, degree=degree, batch=2, seq_len=24, head_buckets=1)
    for o in outs:
        assert o["mlp_chunk"] == chunk
        totals = ledger_totals(o["ledger"])
        if not checkpointing:             # (the replay re-runs the blocks' traffic in backward)
            assert totals == expected
        hops = {tag: totals.get(("send", tag), {"count": 0})["count"]
                for tag in ("mlp.weights", "mlp.weights.grad")}
        per_ring = degree - 1 if degree > 1 else 0
        forwards = 2 if checkpointing else 1
        assert hops == {"mlp.weights": cfg.num_layers * (forwards + 1) * per_ring,
                        "mlp.weights.grad": cfg.num_layers * (degree if degree > 1 else 0)}, hops


def _bf16_rank(rank, world, cfg, ids, labels, chunk, dtype=torch.bfloat16, loss_chunk="auto"):
    """TSP in bf16 (weights and activations; `dtype` fp32: the same run unrounded): loss and
    gathered gradients (`chunk`: parallel.mlp_chunk_tokens, `loss_chunk`: loss_chunk_tokens)."""
    from tsp_trainer.model import Transformer
    from tsp_trainer.parallel.loss import global_count, reduce_loss_value
    from tsp_trainer.parallel.mesh import build_mesh
    from tsp_trainer.parallel.schemes import parallelize
    from tests.distributed.tsp_cases import init_model

    mesh = build_mesh(world)
    model = Transformer(cfg)
    init_model(model, 7)
    par = parallelize(model, "tsp", mesh, seq_len=ids.shape[1], mlp_chunk_tokens=chunk,
                      loss_chunk_tokens=loss_chunk)
    model.to(dtype)
    local_ids, local_labels, pos = zigzag.shard_batch(ids, labels, mesh.tsp_rank, mesh.dims.tsp)
    loss_sum, count = model.loss_sum(local_ids, local_labels, pos)
    total = global_count(count, [mesh.tsp])
    (loss_sum / total).backward()
    return {"loss": reduce_loss_value(loss_sum, total, [mesh.tsp]),
            "grads": {k: v.float() for k, v in par.gather_full_grads().items()}}


def _bf16_batch(**extra):
    cfg = model_config("tiny", num_heads=8, num_kv_heads=4, mlp_bias=True, **extra)
    return (cfg, *make_batch(cfg, 2, 24))


for _d in (2, 4):
    _cfg, _ids, _labels = _bf16_batch()
    RUNS.add(_d, ("bf16", "exact"), _bf16_rank, _cfg, _ids, _labels, 10_000, torch.float32)
    RUNS.add(_d, ("bf16", "untiled"), _bf16_rank, _cfg, _ids, _labels, 10_000)
    RUNS.add(_d, ("bf16", "tiled"), _bf16_rank, _cfg, _ids, _labels, 5)
    RUNS.add(_d, ("bf16", "loss_tiled"), _bf16_rank, _cfg, _ids, _labels, 10_000, torch.bfloat16, 5)
# tied embeddings and a padded vocabulary (1,031 rows on 4 ranks)
_cfg, _ids, _labels = _bf16_batch(tie_embeddings=True, vocab_size=1031)
RUNS.add(4, ("bf16_tied_1031", "exact"), _bf16_rank, _cfg, _ids, _labels, 10_000, torch.float32)
RUNS.add(4, ("bf16_tied_1031", "untiled"), _bf16_rank, _cfg, _ids, _labels, 10_000)
RUNS.add(4, ("bf16_tied_1031", "loss_tiled"), _bf16_rank, _cfg, _ids, _labels, 10_000, torch.bfloat16, 3)


@pytest.mark.parametrize("degree", [2, 4])
def test_tiled_mlp_in_bf16_stays_close_to_the_untiled_path(degree):
    """In bf16 a tiled layer accumulates its output and dX in bf16 (each GEMM adds into the bf16
    accumulator, one rounding per ring step or attention owner instead of one at the end; weight
    gradients still in fp32): loss within 1e-3 relative of the untiled bf16 path (fp32
    accumulators), and every gradient's error against the same run in fp32 at most 5e-2 (of its
    largest element) above the untiled bf16 path's own. Measured: loss 0 (2 ranks) and 1e-5 (4
    ranks); the untiled path's worst error 9.2e-2 and 1.3e-1, the tiled one's 5.0e-2 and 8.7e-2,
    at most 4e-3 and 2.9e-2 above the untiled one's (layer 1's k_proj, a gradient of ~1e-5)."""
    exact, untiled, tiled = (RUNS.result(degree, ("bf16", run)) for run in ("exact", "untiled", "tiled"))
    for f, u, t in zip(exact, untiled, tiled):
        assert t["loss"] == pytest.approx(u["loss"], rel=1e-3)
        for name, g in f["grads"].items():
            scale = g.abs().max().item() + 1e-12
            err_tiled = (t["grads"][name] - g).abs().max().item() / scale
            err_untiled = (u["grads"][name] - g).abs().max().item() / scale
            assert err_tiled <= err_untiled + 5e-2, f"{name}: {err_tiled} vs {err_untiled}"
    # the paths differ: bf16 accumulators are not a no-op
    assert any(not torch.equal(t["grads"][n], u["grads"][n])
               for n in untiled[0]["grads"] for u, t in zip(untiled, tiled))


@pytest.mark.parametrize("degree,runs", [(2, "bf16"), (4, "bf16"), (4, "bf16_tied_1031")])
def test_tiled_loss_in_bf16_stays_close_to_the_fp32_accumulating_path(degree, runs):
    """In bf16 with the loss tiled the vocab ring's dX [N/D, h] is a bf16 accumulator (each
    shard's GEMM sums its chunk's product in fp32 and adds it with one rounding: D roundings per
    element instead of one); the logits, softmax, log-sum-exp and target per chunk and the weight
    gradients (over chunks and ranks) stay fp32. Against the untiled bf16 path, whose dX is summed
    in fp32 and rounded once: loss within 1e-3 relative, and every gradient's error against the
    same run in fp32 at most 2e-2 (of its largest element) above the untiled path's own. Measured
    (-s prints it): at most 5.1e-3 above (worst errors 8.3e-2 tiled / 9.2e-2 untiled on 2 ranks,
    1.1e-1 / 1.3e-1 on 4, 3.9e-2 / 3.7e-2 tied with 1,031 rows)."""
    exact, untiled, tiled = (RUNS.result(degree, (runs, run)) for run in ("exact", "untiled", "loss_tiled"))
    worst = {"tiled": 0.0, "untiled": 0.0, "above": 0.0}
    for f, u, t in zip(exact, untiled, tiled):
        assert t["loss"] == pytest.approx(u["loss"], rel=1e-3)
        for name, g in f["grads"].items():
            scale = g.abs().max().item() + 1e-12
            err_tiled = (t["grads"][name] - g).abs().max().item() / scale
            err_untiled = (u["grads"][name] - g).abs().max().item() / scale
            worst = {"tiled": max(worst["tiled"], err_tiled), "untiled": max(worst["untiled"], err_untiled),
                     "above": max(worst["above"], err_tiled - err_untiled)}
            assert err_tiled <= err_untiled + 2e-2, f"{name}: {err_tiled} vs {err_untiled}"
    print(f"\nbf16 tiled loss D={degree} {runs}: worst relative error {worst}")
    # the paths differ: the bf16 dX accumulator is not a no-op
    assert any(not torch.equal(t["grads"][n], u["grads"][n])
               for n in untiled[0]["grads"] for u, t in zip(untiled, tiled))


# Tiled layers: each block norm hands its work to its consumer (parallel/tsp/norm.py), which keeps
# the norm's input and remakes its output per token chunk. (degree, K/V heads, family,
# tsp_recompute, checkpointing, checkpoint_replay_keeps, tokens per MLP chunk, K/V chunk): 2 x 24
# tokens, 48 / D local tokens; Qwen3's per-head q/k norms; GQA, and MQA on 4 ranks (K/V head copies).
QWEN3 = dict(family="qwen3", qk_norm=True)
HANDOFF_CASES = [(1, 2, "qwen3", "full", False, "all", 5, "auto"),
                 (2, 2, "qwen3", "selective", False, "all", 5, "auto"),
                 (2, 4, "qwen3", "none", True, "all", 7, "auto"),
                 (2, 4, "llama_bias_llama3", "full", True, "attention", 5, 3),
                 (4, 2, "qwen3", "full", True, "nothing", 5, "auto"),
                 (4, 2, "qwen3", "selective", True, "attention", 5, 2),
                 (4, 1, "qwen3", "full", False, "all", 3, "auto")]


def _handoff_cfg(kv_heads, family):
    extra = QWEN3 if family == "qwen3" else FAMILY_CFGS[family]
    cfg = model_config("tiny", num_heads=8, num_kv_heads=kv_heads, **extra)
    return (cfg, *make_batch(cfg, 2, 24))


for _d, _kv, _f, _m, _ac, _k, _c, _a in HANDOFF_CASES:
    _cfg, _ids, _labels = _handoff_cfg(_kv, _f)
    RUNS.add(_d, ("norm_handoff", _kv, _f, _m, _ac, _k, _c, _a), tsp_rank, _cfg, 7, _ids, _labels, 1, 0,
             1e-2, False, "adamw", _m, "auto", _ac, _c, False, _k, _a)


@pytest.mark.parametrize("degree,kv_heads,family,mode,checkpointing,keeps,chunk,kv_chunk", HANDOFF_CASES,
                         ids=[f"d{d}-kv{kv}-{f}-{m}{'-ac-' + k if ac else ''}-chunk{c}-kv{a}"
                              for d, kv, f, m, ac, k, c, a in HANDOFF_CASES])
def test_norm_handed_to_its_consumer_matches_single_process(degree, kv_heads, family, mode, checkpointing,
                                                            keeps, chunk, kv_chunk):
    """With the layers' tokens tiled the block norms' outputs are remade per owner projection and
    per ring step from the norms' inputs: the same logits, loss and gradients as one process, the
    norm weights' (summed over the group) included."""
    cfg, ids, labels = _handoff_cfg(kv_heads, family)
    ref = reference(cfg, 7, ids, labels)
    outs = RUNS.result(degree, ("norm_handoff", kv_heads, family, mode, checkpointing, keeps, chunk, kv_chunk))
    _assert_parity(ref, outs)
    assert any("layernorm" in name for name in ref["grads"])
    for o in outs:
        assert o["mlp_chunk"] == chunk
