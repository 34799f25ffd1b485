"""Parity of scheme `ulysses` (parallel/ulysses.py: DeepSpeed's DistributedAttention all-to-alls over
the model-parallel axis) with one process: loss, logits and every gradient, fp32, rtol 1e-5 /
atol 1e-6, on 1, 2 and 4 gloo ranks; GQA with K/V heads fewer than the degree (repeated), document
masking on and off, with and without head chunks (parallel.ulysses_head_chunks: 2, and one query
head per rank and chunk); a checkpoint resumed across schemes (tsp -> ulysses and back). The
all-to-all bytes in the ledger equal their closed form and the bytes DeepSpeed hands to
all_to_all_single; a forward without autograd moves the same bytes in chunks as whole. Head chunks
lower the attention step's peak memory (LiveTensorMemory). All cases of one world size run in one
fork (cheap)."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.distributed.trainer_cases import (assert_matches_reference, assert_resume_as_matches_uninterrupted,
                                              reference_run, train_rank)
from tests.distributed.tsp_cases import init_model, make_batch
from tests.helpers.dist import run_on_ranks
from tsp_trainer.config import ModelConfig
from tsp_trainer.config.validate import check_parallel_shapes
from tsp_trainer.engine.ulysses import distributed_attention
from tsp_trainer.model import Transformer
from tsp_trainer.model.activation_checkpoint import checkpointed_block
from tsp_trainer.model.documents import Documents
from tsp_trainer.model.layers import PositionRuns
from tsp_trainer.model.offload import ActivationOffload
from tsp_trainer.parallel.loss import global_count, reduce_loss_value
from tsp_trainer.parallel.mesh import build_mesh
from tsp_trainer.parallel.schemes import parallelize

pytestmark = pytest.mark.distributed

SEED, BATCH, SEQ = 7, 2, 32
CFGS = {
    "mha": ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
                       intermediate_size=128, max_seq_len=64),
    # GQA, 2 K/V heads: at D = 4 fewer than the degree, each repeated twice
    "gqa": ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=2,
                       intermediate_size=128, max_seq_len=64, qkv_bias=True, o_bias=True),
    # Qwen3: per-head q/k norms (their gradients summed over the whole axis), tied embeddings
    "qwen3": ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=4,
                         intermediate_size=128, max_seq_len=64, family="qwen3", qk_norm=True, tie_embeddings=True),
}
# document lengths of the two rows (no multiple of the degree; one document of one token)
LENGTHS = [[5, 11, 1, 15], [3, 29]]
# (model, documents: None = off, else reset_positions, activation checkpointing, options)
CASES = [(cfg, docs, False, {}) for cfg in CFGS for docs in (None, False, True)]
# checkpointed blocks (the all-to-alls run again in the replay); the loss and the MLP in chunks of
# a few tokens, edges inside documents
CASES += [("gqa", True, True, {}), ("mha", None, True, {"loss_chunk_tokens": 3}),
          ("gqa", False, False, {"loss_chunk_tokens": 5, "mlp_chunk_tokens": 3})]
# head chunks ("per_rank": as many as the query heads per rank, one head per rank and chunk): GQA
# with K/V heads fewer than c D (repeated inside each chunk), documents, checkpointed blocks; the
# ALST stack's tools together: checkpointed block inputs offloaded to host memory, tiled MLP and
# loss, head chunks
CHUNKED = [("gqa", None, False, {"ulysses_head_chunks": 2}), ("gqa", True, False, {"ulysses_head_chunks": "per_rank"}),
           ("qwen3", False, True, {"ulysses_head_chunks": 2}), ("mha", None, False, {"ulysses_head_chunks": "per_rank"}),
           ("gqa", False, True, {"ulysses_head_chunks": 2, "offload_activations": True, "loss_chunk_tokens": 5,
                                 "mlp_chunk_tokens": 3})]
CASES += CHUNKED
TOL = dict(rtol=1e-5, atol=1e-6)


def _positions(docs: bool | None, offset: int = 0, length: int = SEQ) -> PositionRuns:
    runs = PositionRuns.contiguous(length, offset)
    return runs if docs is None else runs.with_documents(Documents.from_lengths(LENGTHS, reset_positions=docs))


@functools.lru_cache(maxsize=None)
def _reference(cfg_name: str, docs: bool | None):
    """One process, the plain model (packed rows masked by their documents when `docs` is set)."""
    cfg = CFGS[cfg_name]
    ids, labels = make_batch(cfg, BATCH, SEQ)
    model = Transformer(cfg)
    init_model(model, SEED)
    pos = _positions(docs)
    with torch.no_grad():
        logits = model(ids, pos)
    loss_sum, count = model.loss_sum(ids, labels, pos)
    (loss_sum / count).backward()
    return {"ids": ids, "labels": labels, "logits": logits, "loss": (loss_sum / count).item(),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def _chunks(cfg: ModelConfig, options: dict, degree: int) -> int:
    c = options.get("ulysses_head_chunks", 1)
    return cfg.num_heads // degree if c == "per_rank" else c


def _a2a_bytes(cfg: ModelConfig, degree: int, checkpointing: bool, chunks: int = 1,
               grad: bool = True) -> dict[str, int]:
    """Closed form of the ledger's all-to-all records for one forward + backward (`grad`; else one
    forward without autograd): per layer, q, k, v and the output go through one all-to-all each
    way, each moving the local tensor [B, S/D, heads, d], fp32. With c head chunks each chunk
    moves its own heads, its K/V heads (Hkv / c, or one shared) repeated up to D: c max(Hkv / c, D)
    in all (c = 1: max(Hkv, D)). The forward ones again under activation checkpointing (the
    block's replay) and with chunks (each chunk's replay in backward)."""
    if degree == 1:
        return {}
    token_bytes = BATCH * SEQ // degree * cfg.head_dim * 4 * cfg.num_layers
    kv = chunks * max(cfg.num_kv_heads // chunks, 1, degree)
    heads = {"q": cfg.num_heads, "k": kv, "v": kv, "o": cfg.num_heads}
    forward_runs = 1 + (checkpointing + (chunks > 1) if grad else 0)
    out = {}
    for name, h in heads.items():
        out[f"all_to_all/attn.a2a.{name}"] = token_bytes * h * forward_runs
        if grad:
            out[f"all_to_all/attn.a2a.d{name}"] = token_bytes * h
    return out


def _count_all_to_all_bytes() -> list[int]:
    """Wrap torch.distributed.all_to_all_single in this (forked) rank: the returned list fills with
    the input bytes of every call DeepSpeed's DistributedAttention makes through deepspeed.comm."""
    sent: list[int] = []
    real = torch.distributed.all_to_all_single

    def counting(output, input, *args, **kwargs):  # noqa: A002 (DeepSpeed passes input=)
        sent.append(input.numel() * input.element_size())
        return real(output, input, *args, **kwargs)
    torch.distributed.all_to_all_single = counting
    return sent


def _ulysses_rank(rank, world, cases, refs):
    mesh = build_mesh(world)
    sent = _count_all_to_all_bytes()
    out = []
    for (cfg_name, docs, checkpointing, options), ref in zip(cases, refs, strict=True):
        cfg = CFGS[cfg_name]
        offload = options.get("offload_activations", False)
        options = {k: v for k, v in options.items() if k != "offload_activations"}
        options = {**options, **({"ulysses_head_chunks": _chunks(cfg, options, world)} if options.get(
            "ulysses_head_chunks") else {})}
        model = Transformer(cfg)
        init_model(model, SEED)
        par = parallelize(model, "ulysses", mesh, seq_len=SEQ, distributed_attention=distributed_attention,
                          **options)
        if checkpointing:
            model.block_wrapper = checkpointed_block
        if offload:                                    # around the checkpoint, as the Trainer does
            model.block_wrapper = ActivationOffload(model.block_wrapper)
        local_ids, local_labels, pos = par.local_batch(
            ref["ids"], ref["labels"], None if docs is None else _positions(docs).documents)
        mesh.ledger.reset()
        sent.clear()
        loss_sum, count = par.loss_sum(local_ids, local_labels, pos)
        total = global_count(count, par.token_comms)
        (loss_sum / total).backward()
        ledger = {k: v["bytes"] for k, v in mesh.ledger.summary().items() if "a2a" in k}
        deepspeed_bytes = sum(sent)
        mesh.ledger.reset()
        with torch.no_grad():
            logits = par.model(local_ids, pos)
        forward_ledger = {k: v["bytes"] for k, v in mesh.ledger.summary().items() if "a2a" in k}
        expected_logits = par.local_batch(ref["logits"], ref["logits"])[0]
        out.append({"loss": reduce_loss_value(loss_sum, total, par.token_comms),
                    "logits_err": (logits - expected_logits).abs().max().item(),
                    "logits_ok": torch.allclose(logits, expected_logits, **TOL),
                    "grads": par.gather_full_grads(), "ledger": ledger, "deepspeed_bytes": deepspeed_bytes,
                    "forward_ledger": forward_ledger, "kv_gathers": mesh.ledger.count(tag="attn.kv")})
    return out, _attention_peaks(mesh) if world > 1 else {}


# the attention step measured for its peak memory: one rank's local q, k, v [1, S/D, 8, 16] (GQA's
# repeated K/V heads would add their own bytes to each chunk; the parity cases above cover it)
MEM_SEQ, MEM_HEADS, MEM_KV, MEM_DIM = 128, 8, 8, 16


def _attention_peaks(mesh) -> dict[int, int]:
    """chunks -> the high-water mark of bytes allocated during one UlyssesAttention forward +
    backward on this rank (LiveTensorMemory: the inputs, output gradient and their gradients'
    accumulation excluded), for 1, 2 and one query head per rank and chunk."""
    from tsp_trainer.parallel.mesh import axis_view
    from tsp_trainer.parallel.ulysses import UlyssesAttention
    from tsp_trainer.tools.memory import LiveTensorMemory

    sp = axis_view(mesh.tsp, "sp")
    gen = torch.Generator().manual_seed(sp.rank)
    t = MEM_SEQ // sp.size
    peaks = {}
    for chunks in sorted({1, 2, MEM_HEADS // sp.size}):
        attn = UlyssesAttention(distributed_attention, sp, head_chunks=chunks)
        q = torch.randn(1, t, MEM_HEADS, MEM_DIM, generator=gen, requires_grad=True)
        k, v = (torch.randn(1, t, MEM_KV, MEM_DIM, generator=gen, requires_grad=True) for _ in range(2))
        dout = torch.randn(1, t, MEM_HEADS * MEM_DIM, generator=gen)
        with LiveTensorMemory() as mem:
            mem.ignore(q, k, v, dout)
            attn(q, k, v, None, sp).backward(dout)
        peaks[chunks] = mem.peak
    return peaks


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ulysses_matches_one_process(world):
    refs = [_reference(cfg_name, docs) for cfg_name, docs, *_ in CASES]
    results = run_on_ranks(_ulysses_rank, world, CASES, refs, timeout=600)
    for rank, (per_case, peaks) in enumerate(results):
        _check_attention_peaks(peaks, world)
        whole = {cfg_name: out["forward_ledger"] for (cfg_name, docs, ac, options), out in zip(CASES, per_case)
                 if (docs, ac, options) == (None, False, {})}
        for (cfg_name, docs, checkpointing, options), ref, out in zip(CASES, refs, per_case, strict=True):
            where = f"rank {rank} {cfg_name} documents={docs} checkpointing={checkpointing} {options}"
            assert out["loss"] == pytest.approx(ref["loss"], rel=1e-5), where
            assert out["logits_ok"], f"{where}: logits off by {out['logits_err']}"
            assert out["grads"].keys() == ref["grads"].keys()
            for name, grad in ref["grads"].items():
                torch.testing.assert_close(out["grads"][name], grad, **TOL, msg=lambda m, w=where, n=name: f"{w} {n}: {m}")
            cfg, chunks = CFGS[cfg_name], _chunks(CFGS[cfg_name], options, world)
            assert out["ledger"] == _a2a_bytes(cfg, world, checkpointing, chunks), where
            # the ledger's closed form is what DeepSpeed handed to all_to_all_single
            assert out["deepspeed_bytes"] == sum(out["ledger"].values()), where
            assert out["forward_ledger"] == _a2a_bytes(cfg, world, False, chunks, grad=False), where
            if chunks * max(cfg.num_kv_heads // chunks, 1, world) == max(cfg.num_kv_heads, world):
                # no K/V head repeated beyond c = 1's: a forward moves the same bytes in chunks
                assert out["forward_ledger"] == whole[cfg_name], where
            assert out["kv_gathers"] == 0, where


def _check_attention_peaks(peaks: dict[int, int], world: int) -> None:
    """With c chunks the attention step's peak is lower than whole by at least (1 - 1/c) of one
    full-sequence tensor of all local heads, [1, S, H/D, d] fp32 (measured at S = 128, D = 2:
    296,960 bytes whole, 263,168 in 2 chunks, 204,800 in 4; the bound takes 16,384 and 24,576 off)."""
    if world == 1:
        return
    full_sequence = MEM_SEQ * (MEM_HEADS // world) * MEM_DIM * 4
    assert set(peaks) == {1, 2, MEM_HEADS // world}
    for chunks, peak in peaks.items():
        assert peak <= peaks[1] - (1 - 1 / chunks) * full_sequence, (world, peaks)



@pytest.mark.parametrize("stage", [1, 2])
def test_trainer_runs_ulysses_like_one_process(stage):
    """parallel.scheme=ulysses through the whole Trainer (DP 2 x D 2 on 4 ranks, ZeRO-1 and ZeRO-2
    over dp, the tiny recipe, 4 steps) equals one process on the same global batches, with the
    tolerances argued in tests/distributed/test_trainer.py; the loss goes down."""
    overrides = ["train.steps=4", "checkpoint.enabled=false", f"zero.stage={stage}", "parallel.scheme=ulysses"]
    reference = reference_run(overrides, dp_degree=2)
    outs = run_on_ranks(train_rank, 4, overrides, timeout=600)
    assert outs[0]["dp_world_size"] == 2
    assert_matches_reference(outs, reference)


BAD_SHAPES = [
    # q heads not divisible by the degree
    (dict(num_heads=6, num_kv_heads=2), 4, 32, r"parallel.tsp_degree=4 does not divide model.num_heads=6"),
    # a sequence not divisible by the degree (DistributedAttention would return wrong values)
    (dict(num_heads=8, num_kv_heads=4), 4, 30, r"data.seq_len=30 is not divisible by parallel.tsp_degree=4"),
    # K/V heads that neither divide nor are divided by the degree
    (dict(num_heads=12, num_kv_heads=6), 4, 32, r"parallel.tsp_degree=4 and model.num_kv_heads=6 divide "
                                                r"neither way"),
    (dict(num_heads=12, num_kv_heads=3), 2, 32, r"parallel.tsp_degree=2 and model.num_kv_heads=3 divide "
                                                r"neither way"),
]


@pytest.mark.parametrize("heads,degree,seq_len,match", BAD_SHAPES)
def test_bad_shapes_are_refused_with_one_line(heads, degree, seq_len, match):
    cfg = ModelConfig(vocab_size=256, hidden_size=96, num_layers=1, intermediate_size=128,
                      max_seq_len=64, **heads)
    with pytest.raises(ValueError, match=match) as err:
        check_parallel_shapes(cfg, scheme="ulysses", degree=degree, seq_len=seq_len)
    assert "\n" not in str(err.value)


# one direction in the default suite, the other in the slow tier (each ~6 s)
@pytest.mark.parametrize("first,then", [pytest.param("tsp", "ulysses", marks=pytest.mark.slow),
                                        ("ulysses", "tsp")])
def test_resume_across_schemes(first, then, tmp_path):
    """A 5-step run of `first` (DP 2 x D 2, zero.stage auto: ZeRO-1 over dp for tsp, ZeRO-3 over all
    4 ranks for ulysses) saves step 3; resuming it as `then` trains steps 4 and 5 like the
    uninterrupted run: the same losses (rtol 1e-6: fp32 summation order) and final weights (the
    tolerances of tests/distributed/test_trainer.py)."""
    assert_resume_as_matches_uninterrupted(first, then, tmp_path)
