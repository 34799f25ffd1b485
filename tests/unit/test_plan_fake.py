"""The analytic model against the real code run on fake tensors and the fake process group in
this process (plan/dry_run.py): communication equal to the ledger exactly, saved activations to
the byte, peak activations within 10%, for every scheme, bf16 and fp32, with and without activation
checkpointing, and TSP with parallel.tsp_recompute=selective (without checkpointing, which the
trainer refuses with it); and the 1-and-2-layer extrapolation of the dry run equal to a full-depth
run."""

from __future__ import annotations

import functools
import inspect

import pytest
import torch

from tsp_trainer.config import ModelConfig
from tsp_trainer.plan.activations import activation_memory, tsp_mlp_kept, tsp_selective_saved
from tsp_trainer.plan.communication import model_parallel_comm
from tsp_trainer.plan.layout import Layout
from tsp_trainer.plan.precision import BF16, FP32
from tsp_trainer.plan.dry_run import run_step, simulate
from tsp_trainer.plan.state import param_count

CFG = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
                  intermediate_size=128, max_seq_len=4096)
SEQ = 1024

CASES = [("tsp", 2, {"head_buckets": 2}), ("tsp", 4, {"head_buckets": 1}), ("tp", 2, {}),
         ("tp_sp", 2, {}), ("sp", 2, {}),
         ("tp_x_sp", 4, {"tp_degree": 2, "sp_degree": 2}),
         ("tp_x_sp", 4, {"tp_degree": 2, "sp_degree": 2, "tp_sequence_parallel": True})]
SELECTIVE = [("tsp", 2, {"head_buckets": 2, "tsp_recompute": "selective"}),
             ("tsp", 4, {"head_buckets": 1, "tsp_recompute": "selective"}),
             ("tsp", 2, {"head_buckets": 2, "tsp_recompute": "none"}),
             ("tsp", 4, {"head_buckets": 1, "tsp_recompute": "none"})]


def _step(cfg: ModelConfig, scheme: str, **kw):
    """run_step, once per distinct step in this module (its arguments with their defaults filled
    in): the selective and no-recompute tests read the matrix's runs of the same layout."""
    bound = inspect.signature(run_step).bind(cfg, scheme, **kw)
    bound.apply_defaults()
    return _cached_step(tuple(bound.arguments.items()))


@functools.lru_cache(maxsize=None)
def _cached_step(arguments: tuple):
    return run_step(**dict(arguments))


def _layout(scheme: str, degree: int, kw: dict, **extra) -> Layout:
    axes = ({"tp": kw["tp_degree"], "sp": kw["sp_degree"],
             "tp_sequence_parallel": kw.get("tp_sequence_parallel", False)} if scheme == "tp_x_sp" else {})
    return Layout(scheme, degree, head_buckets=kw.get("head_buckets", 1),
                  tsp_recompute=kw.get("tsp_recompute", "full"), **axes, **extra)


def _ids(case):
    scheme, degree, kw = case
    return f"{scheme}-D{degree}-" + "-".join(f"{k}{v}" for k, v in kw.items())


# A pairwise matrix of layout, activation checkpointing and dtype: every layout runs with and
# without AC and in both dtypes, every (AC, dtype) pair occurs, but not every triple (the dtype
# changes element sizes, which every term multiplies; AC changes which terms there are). Selective
# and no recompute are refused with activation checkpointing (config/validate.py): both dtypes.
LAYOUTS = ([(c, ac, ("bf16", "fp32")[(i + ac) % 2]) for i, c in enumerate(CASES) for ac in (False, True)]
           + [(c, False, dtype) for c in SELECTIVE for dtype in ("bf16", "fp32")])


@pytest.mark.parametrize("case,ac,dtype", LAYOUTS,
                         ids=[f"{_ids(c)}-{'AC' if ac else 'noAC'}-{d}" for c, ac, d in LAYOUTS])
def test_analytic_model_matches_the_code_on_fake_tensors(case, dtype, ac):
    scheme, degree, kw = case
    prec, torch_dtype = (BF16, torch.bfloat16) if dtype == "bf16" else (FP32, torch.float32)
    res = _step(CFG, scheme, world_size=2 * degree, degree=degree, seq_len=SEQ, dtype=torch_dtype,
                activation_checkpointing=ac, rank=0, **kw)
    layout = _layout(scheme, degree, kw, dp=2, activation_checkpointing=ac)
    comm = {k: {"count": v["count"], "bytes": v["bytes"]}
            for k, v in model_parallel_comm(CFG, layout, SEQ, prec).items()}
    assert comm == res.comm
    act = activation_memory(CFG, layout, SEQ, prec, device="cpu")
    assert act.stored == pytest.approx(res.stored_bytes, rel=0.01)
    # the model describes rank 0; the other ranks' peaks are within a few percent of it
    # (test_every_rank_saves_and_sends_what_rank_zero_does)
    assert act.peak == pytest.approx(res.peak_bytes, rel=0.10)



# A vocabulary that dominates (16K rows against h = 64, 512 or 1,024 local tokens): the loss phase
# is the peak, with one [64, V/T] fp32 logits block per chunk.
BIG_VOCAB = CFG.replace(vocab_size=16_384)
TILED = [("tsp", 2, {}), ("tp", 2, {}), ("tp_sp", 2, {}), ("sp", 2, {})]


# Pairwise with the dtype, as LAYOUTS: the schemes take bf16 and fp32 in turn (the dtype scales
# the terms; the chunked [64, V/T] logits block is fp32 in both).
TILED_DTYPES = [(c, ("bf16", "fp32")[i % 2]) for i, c in enumerate(TILED)]


@pytest.mark.parametrize("case,dtype", TILED_DTYPES, ids=[f"{_ids(c)}-{d}" for c, d in TILED_DTYPES])
def test_the_loss_phase_model_follows_the_chunk(case, dtype):
    scheme, degree, kw = case
    prec, torch_dtype = (BF16, torch.bfloat16) if dtype == "bf16" else (FP32, torch.float32)
    res = run_step(BIG_VOCAB, scheme, world_size=degree, degree=degree, seq_len=SEQ, dtype=torch_dtype,
                   rank=0, loss_chunk_tokens=64, **kw)
    layout = _layout(scheme, degree, kw)
    act = activation_memory(BIG_VOCAB, layout, SEQ, prec, device="cpu", loss_chunk_tokens=64)
    whole = activation_memory(BIG_VOCAB, layout, SEQ, prec, device="cpu")
    assert (act.terms["loss_chunk_tokens"], act.peak_phase) == (64, "loss")
    assert whole.terms["loss_chunk_tokens"] == SEQ // (1 if scheme.startswith("tp") else degree)
    assert act.phases["loss"] < 0.6 * whole.phases["loss"]      # the block was most of it
    assert act.stored == pytest.approx(res.stored_bytes, rel=0.01)
    assert act.peak == pytest.approx(res.peak_bytes, rel=0.10)


# An MLP that dominates (I = 32 h, 512 or 1,024 local tokens): the MLP's phases are the peak; in
# chunks of 64 tokens its intermediates are [64, I/D] and a TSP layer's accumulators bf16.
BIG_MLP = CFG.replace(intermediate_size=2_048)
TILED_MLP = [(("tsp", 2, {}), False), (("tsp", 2, {}), True), (("tsp", 4, {}), False),
             (("tp", 2, {}), False), (("tp_sp", 2, {}), True), (("sp", 2, {}), False)]


# Pairwise with the dtype: the cases take bf16 and fp32 in turn, so TSP's chunked MLP (its
# accumulators in the activation dtype) runs in both, and so does activation checkpointing.
TILED_MLP_DTYPES = [(c, ac, ("bf16", "fp32")[i % 2]) for i, (c, ac) in enumerate(TILED_MLP)]


@pytest.mark.parametrize("case,ac,dtype", TILED_MLP_DTYPES,
                         ids=[f"{_ids(c)}-{'AC' if ac else 'noAC'}-{d}" for c, ac, d in TILED_MLP_DTYPES])
def test_the_mlp_phase_model_follows_the_chunk(case, ac, dtype):
    scheme, degree, kw = case
    step = dict(world_size=degree, degree=degree, seq_len=SEQ, activation_checkpointing=ac, rank=0,
                dtype=torch.bfloat16 if dtype == "bf16" else torch.float32, **kw)
    res, whole = (run_step(BIG_MLP, scheme, mlp_chunk_tokens=c, **step) for c in (64, "auto"))
    layout = _layout(scheme, degree, kw, activation_checkpointing=ac)
    act = activation_memory(BIG_MLP, layout, SEQ, BF16 if dtype == "bf16" else FP32, device="cpu",
                            mlp_chunk_tokens=64)
    assert act.terms["mlp_chunk_tokens"] == 64
    assert res.peak_bytes < 0.9 * whole.peak_bytes               # the tiling is real
    assert act.stored == pytest.approx(res.stored_bytes, rel=0.01)
    assert act.peak == pytest.approx(res.peak_bytes, rel=0.10)


@pytest.mark.parametrize("degree,buckets", [(2, 2), (4, 1)])
def test_selective_keeps_its_items_and_not_the_gathered_kv(degree, buckets):
    """What selective recompute keeps beyond full recompute is exactly q, k/v, the attention
    output, the kernel's output and log-sum-exp of every item (`tsp_selective_saved`), to 64
    bytes per layer: the attention kernel's views of the gathered K/V are dropped (keeping them
    would add a whole layer's gathered K/V, 2 e S h_kv per layer, several times the margin)."""
    kw = dict(world_size=2 * degree, degree=degree, seq_len=SEQ, head_buckets=buckets, rank=0)
    full, sel = (_step(CFG, "tsp", tsp_recompute=mode, **kw) for mode in ("full", "selective"))
    kept = tsp_selective_saved(CFG, Layout("tsp", degree, head_buckets=buckets, tsp_recompute="selective"),
                               SEQ, BF16)
    gathered_kv = 2 * 2 * SEQ * CFG.kv_hidden_size
    assert kept > 0 and gathered_kv > 64 * 8
    assert abs((sel.stored_bytes - full.stored_bytes) - CFG.num_layers * kept) <= 64 * CFG.num_layers
    assert sel.comm == full.comm                 # the backward re-gathers what full recompute gathers


@pytest.mark.parametrize("degree,buckets", [(2, 2), (4, 1)])
def test_recompute_none_keeps_exactly_the_mlp_gate_and_up_beyond_selective(degree, buckets):
    """What tsp_recompute=none keeps beyond selective is exactly every ring step's gate and up
    pre-activations, [B S/D, I/D] each in the activation dtype (`tsp_mlp_kept`: 2 e B S/D I per
    layer), to 64 bytes per layer; the communication is selective's."""
    kw = dict(world_size=2 * degree, degree=degree, seq_len=SEQ, head_buckets=buckets, rank=0)
    sel, none = (_step(CFG, "tsp", tsp_recompute=mode, **kw) for mode in ("selective", "none"))
    kept = tsp_mlp_kept(CFG, Layout("tsp", degree, head_buckets=buckets, tsp_recompute="none"), SEQ, BF16)
    assert kept == 2 * 2 * (SEQ // degree) * CFG.intermediate_size
    assert abs((none.stored_bytes - sel.stored_bytes) - CFG.num_layers * kept) <= 64 * CFG.num_layers
    assert none.comm == sel.comm


@pytest.mark.parametrize("degree,dtype", [(2, "bf16"), (4, "fp32")])
def test_recompute_none_mlp_backward_peak(degree, dtype):
    """An MLP-heavy shape (I = 16 h, a small vocabulary) puts tsp_recompute=none's peak in the
    MLP ring's backward, where the kept g, u of every shard meet the step's own intermediates:
    the model's peak (that phase) within 10% of the code's on fake tensors, saved to 1%."""
    cfg = CFG.replace(vocab_size=64, intermediate_size=16 * CFG.hidden_size)
    prec, torch_dtype = (BF16, torch.bfloat16) if dtype == "bf16" else (FP32, torch.float32)
    res = run_step(cfg, "tsp", world_size=2 * degree, degree=degree, seq_len=SEQ, dtype=torch_dtype,
                   rank=0, tsp_recompute="none")
    act = activation_memory(cfg, Layout("tsp", degree, dp=2, tsp_recompute="none"), SEQ, prec, device="cpu")
    assert act.peak_phase == "backward"
    assert act.stored == pytest.approx(res.stored_bytes, rel=0.01)
    assert act.peak == pytest.approx(res.peak_bytes, rel=0.10)


@pytest.mark.parametrize("scheme,kw", [("sp", {}), ("tsp", {"head_buckets": 1})], ids=["sp", "tsp"])
def test_every_rank_saves_and_sends_what_rank_zero_does(scheme, kw):
    """The plan describes rank 0 for all ranks: under zigzag every rank holds two chunks, saves the
    same activations and issues the same communication, byte for byte; the peaks differ by a few
    percent, each within the model's 10% of rank 0. One layer: every layer saves and sends the
    same (the extrapolation tests below)."""
    degree, cfg = 4, CFG.replace(num_layers=1)
    runs = [run_step(cfg, scheme, world_size=degree, degree=degree, seq_len=SEQ, rank=r, **kw)
            for r in range(degree)]
    assert [r.comm for r in runs] == [runs[0].comm] * degree
    assert [r.stored_bytes for r in runs] == [runs[0].stored_bytes] * degree
    peaks = [r.peak_bytes for r in runs]
    assert max(peaks) <= 1.05 * min(peaks), peaks
    act = activation_memory(cfg, _layout(scheme, degree, kw), SEQ, BF16, device="cpu")
    assert peaks == [pytest.approx(act.peak, rel=0.10)] * degree, (peaks, act.peak)


def test_extrapolation_from_two_layers_equals_a_full_depth_run():
    cfg = CFG.replace(num_layers=4)
    kw = dict(world_size=8, degree=2, seq_len=SEQ, head_buckets=2, activation_checkpointing=True)
    guess = simulate(cfg, "tsp", **kw)
    full = simulate(cfg, "tsp", layers=4, **kw)
    assert guess.info["extrapolated_from_layers"] == [1, 2]
    assert guess.comm == full.comm
    assert (guess.stored_bytes, guess.peak_bytes) == (full.stored_bytes, full.peak_bytes)
    assert (guess.param_count, guess.param_bytes) == (full.param_count, full.param_bytes)


def test_extrapolation_with_activation_offload_equals_a_full_depth_run():
    """Under activation offload the device holds at most two blocks' saved tensors, so the dry run
    extrapolates from 2 and 3 layers: device peak, saved bytes, host bytes and ledger equal a
    4-layer run's (the planner's offload layout: no AC)."""
    cfg = CFG.replace(num_layers=4)
    kw = dict(world_size=4, degree=4, seq_len=SEQ, offload_activations=True, attention="cuda")
    guess = simulate(cfg, "tsp", **kw)
    full = simulate(cfg, "tsp", layers=4, **kw)
    assert guess.info["extrapolated_from_layers"] == [2, 3]
    assert guess.comm == full.comm
    assert (guess.stored_bytes, guess.peak_bytes, guess.host_bytes) == \
        (full.stored_bytes, full.peak_bytes, full.host_bytes)
    per_layer = activation_memory(cfg, Layout("tsp", 4, offload_activations=True), SEQ, BF16,
                                  device="cuda").terms["layer_saved_no_ac"]
    assert full.host_bytes == 4 * per_layer                 # every layer's saved tensors moved


# K/V heads fewer than D (MQA): each rank holds a copy of the one K/V head (weights, gradients and
# optimizer state count it on every rank), TSP gathers it once per sharing group, the copies'
# gradients are summed over the sharers (kv.grad). Parameters and communication exact, saved
# activations to 1%, the peak within 10%.
MQA = CFG.replace(num_kv_heads=1)
FEW_KV = [("tsp", 4, {"tsp_recompute": "selective"}, False, "fp32"), ("tp", 4, {}, False, "fp32"),
          ("tp_x_sp", 4, {"tp_degree": 2, "sp_degree": 2}, True, "bf16")]


@pytest.mark.parametrize("case", FEW_KV, ids=[_ids(c[:3]) for c in FEW_KV])
def test_the_model_counts_the_copies_of_kv_heads_fewer_than_the_degree(case):
    scheme, degree, kw, ac, dtype = case
    prec, torch_dtype = (BF16, torch.bfloat16) if dtype == "bf16" else (FP32, torch.float32)
    res = run_step(MQA, scheme, world_size=2 * degree, degree=degree, seq_len=SEQ, dtype=torch_dtype,
                   activation_checkpointing=ac, rank=0, **kw)
    layout = _layout(scheme, degree, kw, dp=2, activation_checkpointing=ac)
    assert param_count(MQA, layout) == res.param_count
    # a copy of one K/V head per rank: what T K/V heads split T ways give each rank
    t = layout.axes[0]
    assert param_count(MQA, layout) == param_count(CFG.replace(num_kv_heads=t), layout)
    comm = {k: {"count": v["count"], "bytes": v["bytes"]}
            for k, v in model_parallel_comm(MQA, layout, SEQ, prec).items()}
    assert comm == res.comm
    assert any(k.endswith("kv.grad") for k in comm)
    act = activation_memory(MQA, layout, SEQ, prec, device="cpu")
    assert act.stored == pytest.approx(res.stored_bytes, rel=0.01)
    assert act.peak == pytest.approx(res.peak_bytes, rel=0.10)


def test_offload_fetching_on_demand_holds_one_block_input_less_and_nesting_regains_on_the_host():
    """Checkpointed TSP under activation offload on fake tensors: nesting (k = 2) leaves the device
    peak at per-block checkpointing's (its regained inner inputs wait on the host, whose peak is
    the planner's: of 4 layers, 2 kept + 1 regained), and fetching on demand
    (train.offload_prefetch=false) lowers it by exactly one block input, as the planner says."""
    cfg, seq = CFG.replace(num_layers=4), 256
    kw = dict(world_size=4, degree=4, seq_len=seq, offload_activations=True, activation_checkpointing=True,
              attention="cuda")
    runs, plans = {}, {}
    for k, prefetch in ((1, True), (2, True), (2, False)):
        runs[k, prefetch] = simulate(cfg, "tsp", layers=4, checkpoint_segment_blocks=k,
                                     offload_prefetch=prefetch, **kw)
        plans[k, prefetch] = activation_memory(cfg, Layout("tsp", 4, activation_checkpointing=True,
                                                           offload_activations=True, checkpoint_segment_blocks=k,
                                                           offload_prefetch=prefetch), seq, BF16, device="cuda")
    block_input = plans[1, True].terms["ac_block_input"]
    assert runs[2, True].peak_bytes == runs[1, True].peak_bytes
    assert plans[2, True].peak == plans[1, True].peak
    assert runs[2, True].peak_bytes - runs[2, False].peak_bytes == block_input
    assert plans[2, True].peak - plans[2, False].peak == block_input
    for key, run in runs.items():
        assert run.host_bytes == plans[key].host, key
        assert run.peak_bytes == pytest.approx(plans[key].peak, rel=0.10), key
    assert runs[2, False].host_bytes == 3 * block_input


@pytest.mark.slow
def test_nested_extrapolation_with_a_shorter_last_segment_equals_a_full_depth_run():
    """Under nesting with offload (k = 2 over 9 layers: the last segment has one block) the dry
    run extrapolates from runs that end in a segment as short as the model's (5 and 7 layers):
    device peak, saved bytes, host bytes, parameters and ledger equal a 9-layer run's, and the
    host bytes are the planner's (4 kept + 1 regained block inputs)."""
    cfg, seq = CFG.replace(num_layers=9), 256
    kw = dict(world_size=4, degree=4, seq_len=seq, offload_activations=True, activation_checkpointing=True,
              attention="cuda", checkpoint_segment_blocks=2, offload_prefetch=False)
    guess = simulate(cfg, "tsp", **kw)
    full = simulate(cfg, "tsp", layers=9, **kw)
    assert guess.info["extrapolated_from_layers"] == [5, 7]
    assert guess.comm == full.comm
    assert (guess.stored_bytes, guess.peak_bytes, guess.host_bytes) == \
        (full.stored_bytes, full.peak_bytes, full.host_bytes)
    assert (guess.param_count, guess.param_bytes) == (full.param_count, full.param_bytes)
    plan = activation_memory(cfg, Layout("tsp", 4, activation_checkpointing=True, offload_activations=True,
                                         checkpoint_segment_blocks=2, offload_prefetch=False), seq, BF16,
                             device="cuda")
    assert full.host_bytes == plan.host == 5 * plan.terms["ac_block_input"]
