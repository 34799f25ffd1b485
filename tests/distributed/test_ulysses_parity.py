"""Parity of scheme `ulysses` (parallel/ulysses.py: DeepSpeed's DistributedAttention all-to-alls over
the model-parallel axis) with one process: loss, logits and every gradient, fp32, rtol 1e-5 /
atol 1e-6, on 1, 2 and 4 gloo ranks; GQA with K/V heads fewer than the degree (repeated), document
masking on and off; a checkpoint resumed across schemes (tsp -> ulysses and back). The all-to-all
bytes in the ledger equal their closed form and the bytes DeepSpeed hands to all_to_all_single. All cases of one world size run in one fork (cheap)."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.distributed.trainer_cases import assert_matches_reference, reference_run, train_rank
from tests.distributed.tsp_cases import init_model, make_batch
from tests.helpers.dist import run_on_ranks
from tsp_trainer.config import ModelConfig
from tsp_trainer.config.validate import check_parallel_shapes
from tsp_trainer.engine.ulysses import distributed_attention
from tsp_trainer.model import Transformer
from tsp_trainer.model.activation_checkpoint import checkpointed_block
from tsp_trainer.model.documents import Documents
from tsp_trainer.model.layers import PositionRuns
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


def _a2a_bytes(cfg: ModelConfig, degree: int, checkpointing: bool) -> dict[str, int]:
    """Closed form of the ledger's all-to-all records for one forward + backward: per layer, q, k,
    v and the output go through one all-to-all each way, each moving the local tensor
    [B, S/D, heads, d] (K/V heads repeated up to D), fp32; the forward ones twice under activation
    checkpointing (the block's replay)."""
    if degree == 1:
        return {}
    token_bytes = BATCH * SEQ // degree * cfg.head_dim * 4 * cfg.num_layers
    kv = max(cfg.num_kv_heads, degree)
    heads = {"q": cfg.num_heads, "k": kv, "v": kv, "o": cfg.num_heads}
    out = {}
    for name, h in heads.items():
        out[f"all_to_all/attn.a2a.{name}"] = token_bytes * h * (2 if checkpointing else 1)
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
        model = Transformer(cfg)
        init_model(model, SEED)
        par = parallelize(model, "ulysses", mesh, seq_len=SEQ, distributed_attention=distributed_attention,
                          **options)
        if checkpointing:
            model.block_wrapper = checkpointed_block
        local_ids, local_labels, pos = par.local_batch(
            ref["ids"], ref["labels"], None if docs is None else _positions(docs).documents)
        mesh.ledger.reset()
        sent.clear()
        loss_sum, count = par.loss_sum(local_ids, local_labels, pos)
        total = global_count(count, par.token_comms)
        (loss_sum / total).backward()
        ledger = {k: v["bytes"] for k, v in mesh.ledger.summary().items() if "a2a" in k}
        deepspeed_bytes = sum(sent)
        with torch.no_grad():
            logits = par.model(local_ids, pos)
        expected_logits = par.local_batch(ref["logits"], ref["logits"])[0]
        out.append({"loss": reduce_loss_value(loss_sum, total, par.token_comms),
                    "logits_err": (logits - expected_logits).abs().max().item(),
                    "logits_ok": torch.allclose(logits, expected_logits, **TOL),
                    "grads": par.gather_full_grads(), "ledger": ledger, "deepspeed_bytes": deepspeed_bytes,
                    "kv_gathers": mesh.ledger.count(tag="attn.kv")})
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ulysses_matches_one_process(world):
    refs = [_reference(cfg_name, docs) for cfg_name, docs, *_ in CASES]
    results = run_on_ranks(_ulysses_rank, world, CASES, refs, timeout=600)
    for rank, per_case in enumerate(results):
        for (cfg_name, docs, checkpointing, options), ref, out in zip(CASES, refs, per_case, strict=True):
            where = f"rank {rank} {cfg_name} documents={docs} checkpointing={checkpointing} {options}"
            assert out["loss"] == pytest.approx(ref["loss"], rel=1e-5), where
            assert out["logits_ok"], f"{where}: logits off by {out['logits_err']}"
            assert out["grads"].keys() == ref["grads"].keys()
            for name, grad in ref["grads"].items():
                torch.testing.assert_close(out["grads"][name], grad, **TOL, msg=lambda m, w=where, n=name: f"{w} {n}: {m}")
            assert out["ledger"] == _a2a_bytes(CFGS[cfg_name], world, checkpointing), where
            # the ledger's closed form is what DeepSpeed handed to all_to_all_single
            assert out["deepspeed_bytes"] == sum(out["ledger"].values()), where
            assert out["kv_gathers"] == 0, where



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


@pytest.mark.parametrize("first,then", [("tsp", "ulysses"), ("ulysses", "tsp")])
def test_resume_across_schemes(first, then, tmp_path):
    """A 5-step run of `first` (DP 2 x D 2, zero.stage auto: ZeRO-1 over dp for tsp, ZeRO-3 over all
    4 ranks for ulysses) saves step 3; resuming it as `then` trains steps 4 and 5 like the
    uninterrupted run: the same losses (rtol 1e-6: fp32 summation order) and final weights (the
    tolerances of tests/distributed/test_trainer.py)."""
    common = ["train.steps=5", "checkpoint.keep_last=5"]
    full = run_on_ranks(train_rank, 4, common + [f"parallel.scheme={first}", "checkpoint.every=3",
                                                 f"train.output_dir={tmp_path / 'a'}"], timeout=600)
    step3 = tmp_path / "a" / "checkpoints" / "step_00000003"
    resumed = run_on_ranks(train_rank, 4, common + [f"parallel.scheme={then}", f"train.resume={step3}",
                                                    f"train.output_dir={tmp_path / 'b'}"], timeout=600)
    assert resumed[0]["step"] == 5
    assert resumed[0]["losses"] == pytest.approx(full[0]["losses"][3:], rel=1e-6)
    close, total = 0, 0
    for name, w in full[0]["weights"].items():
        got = resumed[0]["weights"][name]
        torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-4, msg=name)
        close += int(((got - w).abs() <= 1e-6 + 1e-5 * w.abs()).sum())
        total += w.numel()
    assert close / total > 0.999
