"""Nested checkpointing (train.checkpoint_segment_blocks, model/activation_checkpoint.py) is exact:
keeping one block input per segment of k blocks and re-running the segment forward in backward
gives the same loss and every gradient as per-block checkpointing, bit for bit (the same values
computed in the same order), on 1, 2 and 4 gloo ranks, with GQA, document masking on and off, the
offload of the kept inputs on and off (with it the inner inputs regained on the host, fetched
ahead or on demand: train.offload_prefetch), for TSP and the baselines. It costs exactly
L - ceil(L / k) more block forwards (counted), and the host holds ceil(L / k) block inputs
instead of L. Through the Trainer: tests/distributed/test_trainer.py's checkpointed case."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.tsp_cases import init_model
from tests.helpers.dist import ForkedCases
from tsp_trainer.config import ModelConfig
from tsp_trainer.model import Transformer
from tsp_trainer.model.activation_checkpoint import wrap_blocks
from tsp_trainer.model.documents import Documents
from tsp_trainer.model.layers import PositionRuns
from tsp_trainer.parallel.loss import global_count
from tsp_trainer.parallel.mesh import build_mesh
from tsp_trainer.parallel.schemes import parallelize
from tsp_trainer.parallel.tsp.comm_model import ledger_totals
from tsp_trainer.plan.communication import model_parallel_comm
from tsp_trainer.plan.layout import Layout
from tsp_trainer.plan.precision import FP32

SEED, SEQ = 5, 32
# 3 layers: segments of 2 (2, 1) end in a shorter one, a segment of 3 is the whole model
CFG = ModelConfig(vocab_size=256, hidden_size=64, num_layers=3, num_heads=8, num_kv_heads=4,
                  intermediate_size=128, max_seq_len=64, qkv_bias=True, o_bias=True)
LENGTHS = [[5, 11, 1, 15], [3, 29]]
# (name, checkpoint_segment_blocks, offload, prefetch): the first is the per-block reference
VARIANTS = (("per_block", 1, False, True), ("per_block_offload", 1, True, True), ("k2", 2, False, True),
            ("k3_offload", 3, True, True), ("k2_offload_on_demand", 2, True, False))


def _batch():
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, CFG.vocab_size, (len(LENGTHS), SEQ + 1), generator=gen)
    labels = tokens[:, 1:].clone()
    labels[1, :2] = -100
    return tokens[:, :-1].contiguous(), labels


def _variants(model, loss_sum, comms, ledger=None) -> dict:
    """Each VARIANTS entry on `model`: loss sum, gradients (named as the model's parameters),
    block forwards run, host bytes after the forward and (given the mesh's ledger) the step's
    model-parallel ops."""
    calls = [0]
    hooks = [b.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)) for b in model.layers]
    out = {}
    for name, k, offload, prefetch in VARIANTS:
        wrap_blocks(model, checkpointing=True, offload=offload, segment_blocks=k, prefetch=prefetch)
        model.zero_grad(set_to_none=True)
        calls[0] = 0
        if ledger is not None:
            ledger.reset()
        total, count = loss_sum()
        host = model.block_wrapper.host_bytes if offload else 0
        (total / global_count(count, comms)).backward()
        ops = {} if ledger is None else {f"{op}/{tag}": v for (op, tag), v in ledger_totals(ledger.records).items()}
        out[name] = {"loss": total.detach().clone(), "calls": calls[0], "host": host, "ledger": ops,
                     "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}
    for h in hooks:
        h.remove()
    return out


def _rank(rank, world, scheme, options, masking):
    mesh = build_mesh(world)
    model = Transformer(CFG)
    init_model(model, SEED)
    ids, labels = _batch()
    par = parallelize(model, scheme, mesh, seq_len=SEQ, **options)
    docs = Documents.from_lengths(LENGTHS) if masking else None
    local_ids, local_labels, pos = par.local_batch(ids, labels, docs)
    return _variants(model, lambda: par.loss_sum(local_ids, local_labels, pos), par.token_comms,
                     mesh.ledger)


def _assert_exact(out: dict, where: str) -> None:
    ref, L = out["per_block"], CFG.num_layers
    assert ref["calls"] == 2 * L, where                       # per-block: forward + replay
    per_input = out["per_block_offload"]["host"] / L          # per-block offload: every block input
    assert per_input > 0
    for name, k, offload, _ in VARIANTS[1:]:
        got = out[name]
        assert torch.equal(got["loss"], ref["loss"]), f"{where} {name} loss"
        assert got["grads"].keys() == ref["grads"].keys()
        for p, g in ref["grads"].items():
            assert torch.equal(got["grads"][p], g), f"{where} {name} grad {p}"
        segments = -(-L // k)
        assert got["calls"] == 2 * L + (L - segments), f"{where} {name} forwards"
        if offload:                                           # one block input per segment
            assert got["host"] == segments * per_input, f"{where} {name} host"


RUNS = ForkedCases()
# (scheme, world, options, document masking)
CASES = [("tsp", 2, {}, False), ("tsp", 2, {"head_buckets": 2}, True), ("tp", 2, {}, True),
         ("tsp", 4, {}, True), ("sp", 4, {}, False), ("tp_sp", 4, {}, True),
         ("tp_x_sp", 4, {"tp_degree": 2, "sp_degree": 2}, False)]


def _key(scheme, options, masking):
    return scheme, tuple(sorted(options.items())), masking


for _s, _w, _o, _m in CASES:
    RUNS.add(_w, _key(_s, _o, _m), _rank, _s, _o, _m)


def test_nested_checkpointing_equals_per_block_on_one_process():
    """With document masking (the forked cases take it on and off)."""
    model = Transformer(CFG)
    init_model(model, SEED)
    ids, labels = _batch()
    positions = PositionRuns.contiguous(SEQ).with_documents(Documents.from_lengths(LENGTHS))
    out = _variants(model, lambda: model.loss_sum(ids, labels, positions), [])
    _assert_exact(out, "1 process")


def test_no_checkpointing_runs_each_block_once_and_nesting_needs_checkpointing():
    model = Transformer(CFG)
    wrap_blocks(model, checkpointing=False, offload=False)
    assert model.block_wrapper is None and list(model.block_units()) == list(model.layers)
    with pytest.raises(ValueError, match="checkpoint_segment_blocks=2 needs activation checkpointing"):
        wrap_blocks(model, checkpointing=False, offload=True, segment_blocks=2)
    model.blocks_per_call = 2
    units = model.block_units()
    assert [len(u) for u in units] == [2, 1] and model.block_units() is units   # built once


@pytest.mark.distributed
@pytest.mark.parametrize("scheme,world,options,masking", CASES,
                         ids=[f"{s}-d{w}{'-nb2' if o.get('head_buckets') else ''}{'-docs' if m else ''}"
                              for s, w, o, m in CASES])
def test_nested_checkpointing_equals_per_block(scheme, world, options, masking):
    for rank, out in enumerate(RUNS.result(world, _key(scheme, options, masking))):
        _assert_exact(out, f"rank {rank}")
        # the planner's ledger counts the re-run block forwards (plan/communication.py)
        axes = {"tp": 2, "sp": 2} if scheme == "tp_x_sp" else {}
        for name, k, *_ in VARIANTS:
            layout = Layout(scheme, world, micro_batch=len(LENGTHS), activation_checkpointing=True,
                            checkpoint_segment_blocks=k, head_buckets=options.get("head_buckets", 1), **axes)
            model = {key: {"count": v["count"], "bytes": v["bytes"]}
                     for key, v in model_parallel_comm(CFG, layout, SEQ, FP32).items()}
            assert out[name]["ledger"] == model, f"rank {rank} {name} ledger"
