"""The planner without any process group: closed forms on small configs, the CLI (tables, JSON,
PNG, error messages and exit codes), and ranking sanity at the paper's scale."""

from __future__ import annotations

import json

import pytest

from tsp_trainer.config import ModelConfig
from tsp_trainer.config.model import model_config
from tsp_trainer.model import Transformer
from tsp_trainer.observability.flops import flops_per_token
from tsp_trainer.observability.metrics import DEVICE_PEAK_FLOPS
from tsp_trainer.parallel.tsp.comm_model import tsp_step_comm
from tsp_trainer.plan import cli
from tsp_trainer.plan.activations import activation_memory, tsp_mlp_kept, tsp_selective_saved
from tsp_trainer.plan.communication import (WIRE_FACTOR, data_parallel_comm, model_parallel_comm,
                                            wire_bytes)
from tsp_trainer.plan.efficiency import KERNEL_EFFICIENCY
from tsp_trainer.plan.flops import hardware_flops_per_token
from tsp_trainer.plan.hardware import PROFILES, get_profile
from tsp_trainer.plan.layout import Layout
from tsp_trainer.plan.precision import BF16, FP32
from tsp_trainer.plan.predict import OVERLAPPABLE_TAGS, Assumptions, predict
from tsp_trainer.plan.state import param_count, state_bytes
from tsp_trainer.plan.search import PlanError, candidate_layouts, plan

SMALL = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
                    intermediate_size=128, max_seq_len=4096)
GIB = 2 ** 30


# -- hardware ---------------------------------------------------------------------------------

def test_profiles_take_peaks_from_observability():
    for name, profile in PROFILES.items():
        assert profile.peak_flops == DEVICE_PEAK_FLOPS[name]
        assert profile.gpus_per_node == 8
    assert PROFILES["h200"].hbm_bytes > PROFILES["h100"].hbm_bytes
    assert PROFILES["mi300x"].p2p_bw < PROFILES["mi300x"].intra_node_bw   # one xGMI link per peer
    assert get_profile("H100", gpus_per_node=4).gpus_per_node == 4
    with pytest.raises(ValueError, match="--gpu='a100' is not a known profile"):
        get_profile("a100")


# -- parameters and optimizer state --------------------------------------------------------------

@pytest.mark.parametrize("scheme,degree,t", [("tsp", 2, 2), ("tp", 2, 2), ("sp", 2, 1), ("tsp", 1, 1)])
def test_param_count_matches_the_model(scheme, degree, t):
    full = sum(p.numel() for p in Transformer(SMALL).parameters())
    assert param_count(SMALL, Layout(scheme, degree)) == (full - 5 * 64) // t + 5 * 64   # norms replicated
    assert param_count(SMALL, Layout("tsp", 1)) == SMALL.num_params() == full


def test_state_bytes_bf16_zero_stages():
    n = param_count(SMALL, Layout("tsp", 2))
    z0 = state_bytes(SMALL, Layout("tsp", 2, dp=4, zero_stage=0), BF16)
    z1 = state_bytes(SMALL, Layout("tsp", 2, dp=4, zero_stage=1), BF16)
    z2 = state_bytes(SMALL, Layout("tsp", 2, dp=4, zero_stage=2), BF16)
    assert (z0["params"], z0["grads"], z0["optimizer"]) == (2 * n, 2 * n, 12 * n)   # 16 B / param
    # fp32 gradient accumulation (engine/deepspeed.py): ZeRO-1 keeps a full fp32 buffer beside the
    # bf16 gradients (DeepSpeed's BF16_Optimizer), ZeRO-2 an fp32 partition
    assert (z1["grads"], z1["optimizer"]) == (6 * n, 3 * n)
    assert (z2["grads"], z2["optimizer"]) == (n, 3 * n)
    assert BF16.zero_stages == (1, 2) and FP32.zero_stages == (0, 1, 2)   # bf16 + ZeRO-0: refused
    fp32 = state_bytes(SMALL, Layout("tsp", 2, zero_stage=0), FP32)
    assert (fp32["params"], fp32["grads"], fp32["optimizer"]) == (4 * n, 4 * n, 8 * n)   # no master


def test_optimizer_offload_moves_master_and_moments_to_the_host():
    """ZeRO-Offload: the fp32 master and the moments leave the GPU (12 B / param under bf16,
    sharded over DP); the gradients stay where ZeRO accumulates them; the host holds master,
    moments, the fp32 gradient partition and the weight-dtype copy sent back (18 B / param bf16,
    20 B fp32: ZeRO's fp32 master is a clone even when the weights are fp32)."""
    n = param_count(SMALL, Layout("tsp", 2))
    for stage, dp in ((1, 1), (2, 4)):
        on = state_bytes(SMALL, Layout("tsp", 2, dp=dp, zero_stage=stage), BF16)
        off = state_bytes(SMALL, Layout("tsp", 2, dp=dp, zero_stage=stage, offload_optimizer=True), BF16)
        assert (off["params"], off["grads"], off["optimizer"]) == (on["params"], on["grads"], 0)
        assert on["optimizer"] == -(-12 * n // dp) and on["host_optimizer"] == 0
        assert off["host_optimizer"] == -(-18 * n // dp)
    fp32 = state_bytes(SMALL, Layout("tsp", 2, zero_stage=1, offload_optimizer=True), FP32)
    assert (fp32["optimizer"], fp32["host_optimizer"]) == (0, 20 * n)
    with pytest.raises(ValueError, match="offload_optimizer with zero_stage=0"):
        Layout("tsp", 2, zero_stage=0, offload_optimizer=True)
    assert " Z1+cpuopt " in Layout("tsp", 2, offload_optimizer=True).label()


# -- activations ----------------------------------------------------------------------------------

def test_tsp_saved_activations_closed_form():
    """TSP saves only what its norms and X_p need: per layer 2 x 2e x (N/D) x h bytes (the norm
    input, the norm output = X_p) + rstd; with AC the block input, and in backward one block's
    replay keeps what tsp_recompute=none keeps (the attention items and the MLP's gate/up), so the
    peak falls below no AC's once there are enough layers."""
    b, s, d, h, e = 1, 1024, 2, 64, 2
    n = b * s // d
    a = activation_memory(SMALL, Layout("tsp", d), s, BF16)
    assert a.stored_per_layer == 2 * (2 * e * n * h + 4 * n)
    ac = activation_memory(SMALL, Layout("tsp", d, activation_checkpointing=True), s, BF16)
    assert ac.stored_per_layer == e * n * h
    none = Layout("tsp", d, tsp_recompute="none")
    assert ac.terms["tsp_replay_kept"] == (tsp_selective_saved(SMALL, none, s, BF16)
                                           + tsp_mlp_kept(SMALL, none, s, BF16)) > 0
    assert a.terms["tsp_replay_kept"] == 0
    assert ac.stored < a.stored
    deep = SMALL.replace(num_layers=16)
    assert (activation_memory(deep, Layout("tsp", d, activation_checkpointing=True), s, BF16).peak
            < activation_memory(deep, Layout("tsp", d), s, BF16).peak)


def test_activation_memory_orders_schemes_like_the_paper():
    """At long context TSP stores ~1/D of TP's activations; TP keeps the full sequence."""
    cfg = model_config("7b")
    s = 131072
    tsp = activation_memory(cfg, Layout("tsp", 8, activation_checkpointing=True), s, BF16)
    tp = activation_memory(cfg, Layout("tp", 8, activation_checkpointing=True), s, BF16)
    # N h e vs N/D h e (+ the baselines' fp32 [N] per checkpointed block)
    assert tp.stored_per_layer == 8 * tsp.stored_per_layer + 4 * s
    assert 5 * GIB < tsp.peak < 12 * GIB < 35 * GIB < tp.peak


def test_head_buckets_shrink_the_transient_kv_buffer():
    cfg = model_config("7b")
    one = activation_memory(cfg, Layout("tsp", 8, head_buckets=1), 131072, BF16)
    four = activation_memory(cfg, Layout("tsp", 8, head_buckets=4), 131072, BF16)
    assert four.terms["transient_kv_bucket"] * 4 == one.terms["transient_kv_bucket"]
    assert four.peak <= one.peak


# -- communication ----------------------------------------------------------------------------------

def test_tsp_comm_is_tsp_step_comm_plus_ac_replay():
    lay = Layout("tsp", 4, head_buckets=1)
    base = tsp_step_comm(SMALL, degree=4, batch=1, seq_len=512, weight_bytes=2, act_bytes=2)
    got = model_parallel_comm(SMALL, lay, 512, BF16)
    as_keys = {tuple(k.split("/", 1)): {"count": v["count"], "bytes": v["bytes"]} for k, v in got.items()}
    assert as_keys == base
    ac = model_parallel_comm(SMALL, Layout("tsp", 4, activation_checkpointing=True), 512, BF16)
    # AC replays the forward: one more round of weight broadcasts, K/V gathers, MLP ring hops
    assert ac["broadcast/attn.weights"]["count"] == got["broadcast/attn.weights"]["count"] * 3 // 2
    assert ac["recv/mlp.weights"]["count"] == got["recv/mlp.weights"]["count"] * 3 // 2
    assert ac["reduce/attn.wgrad"] == got["reduce/attn.wgrad"]


def test_tsp_weight_traffic_is_independent_of_sequence_length():
    w = [model_parallel_comm(SMALL, Layout("tsp", 2), s, BF16)["broadcast/attn.weights"]["bytes"]
         for s in (256, 1024)]
    kv = [model_parallel_comm(SMALL, Layout("tsp", 2), s, BF16)["all_gather/attn.kv"]["bytes"]
          for s in (256, 1024)]
    assert w[0] == w[1] and kv[1] == 4 * kv[0]


def test_dp_comm_and_wire_bytes():
    lay = Layout("tsp", 2, dp=4, zero_stage=2, grad_accum=2)
    dp = data_parallel_comm(SMALL, lay, BF16)
    n = param_count(SMALL, lay)
    assert dp["reduce_scatter/dp.grads"]["bytes"] == 4 * n            # gradients reduced in fp32
    assert dp["all_gather/dp.params"]["bytes"] == 2 * n              # updated bf16 weights
    # bf16 + ZeRO-1 is DeepSpeed's BF16_Optimizer: an all-reduce of the fp32 gradient buffer
    z1 = data_parallel_comm(SMALL, Layout("tsp", 2, dp=4, zero_stage=1), BF16)
    assert z1["all_reduce/dp.grads"]["bytes"] == 4 * n and "all_gather/dp.params" in z1
    assert "reduce_scatter/dp.grads" in data_parallel_comm(SMALL, Layout("tsp", 2, dp=4, zero_stage=1), FP32)
    assert "all_reduce/dp.grads" in data_parallel_comm(SMALL, Layout("tsp", 2, dp=4, zero_stage=0), BF16)
    assert data_parallel_comm(SMALL, Layout("tsp", 2), BF16) == {}
    wire = wire_bytes(dp)
    assert wire["reduce_scatter/dp.grads"] == pytest.approx(4 * n * 3 / 4)


# -- compute and time -------------------------------------------------------------------------------

def test_hardware_flops_count_recompute():
    s = 1024
    model = flops_per_token(SMALL, s)
    L, h, inter = SMALL.num_layers, SMALL.hidden_size, SMALL.intermediate_size
    qkv = 2 * L * h * (SMALL.num_heads * SMALL.head_dim + 2 * SMALL.kv_hidden_size)
    core, gate_up = L * 2 * s * h, 2 * L * 2 * h * inter            # causal attention: half of 4 S h
    o, down, head = 2 * L * h * h, 2 * L * h * inter, 2 * SMALL.vocab_size * h
    flash_rebuild = core / 2                                         # flash backward's Q K^T again
    tp = hardware_flops_per_token(SMALL, Layout("tp", 2), s)
    assert tp == {"model": model, "hardware": model + flash_rebuild}
    tsp = hardware_flops_per_token(SMALL, Layout("tsp", 2), s)["hardware"]
    # full recompute re-runs q/k/v, the attention forward and gate/up in backward (not W_o, W_down),
    # and the vocab ring rebuilds the logits
    assert tsp == model + flash_rebuild + qkv + core + gate_up + head
    sel = hardware_flops_per_token(SMALL, Layout("tsp", 2, tsp_recompute="selective"), s)["hardware"]
    assert sel == model + flash_rebuild + gate_up + head             # selective keeps the attention
    none = hardware_flops_per_token(SMALL, Layout("tsp", 2, tsp_recompute="none"), s)["hardware"]
    assert none == model + flash_rebuild + head                      # no block forward re-run
    tsp_ac = hardware_flops_per_token(SMALL, Layout("tsp", 2, activation_checkpointing=True), s)["hardware"]
    # the whole block replayed, and that replay is TSP's recompute (no third forward)
    assert tsp_ac == none + qkv + core + o + gate_up + down
    tp_ac = hardware_flops_per_token(SMALL, Layout("tp", 2, activation_checkpointing=True), s)["hardware"]
    assert tp_ac == tp["hardware"] + qkv + core + o + gate_up        # the replay stops before down
    sp = hardware_flops_per_token(SMALL, Layout("sp", 2), s)["hardware"]
    assert sp == tp["hardware"] + core                               # context attention re-runs its core

def test_selective_layout_rules_follow_the_trainer():
    """Layout refuses what config/validate.py refuses: selective for a baseline, or with AC or
    activation offload; labels say 'sel'."""
    assert "sel" in Layout("tsp", 2, tsp_recompute="selective").label()
    for kw, match in (({"scheme": "tp"}, "only tsp recomputes by shard"),
                      ({"activation_checkpointing": True}, "activation checkpointing"),
                      ({"offload_activations": True}, "activation offload")):
        args = {"scheme": "tsp", "degree": 2, "tsp_recompute": "selective", **kw}
        with pytest.raises(ValueError, match=match):
            Layout(**args)
    with pytest.raises(ValueError, match="tsp_recompute='partial' is not one of full, selective, none"):
        Layout("tsp", 2, tsp_recompute="partial")


def test_recompute_none_layout_rules_and_kept_bytes():
    """Layout refuses none where it refuses selective (baseline, AC, offload), labels it 'keep',
    and says what each mode keeps; none keeps selective's bytes plus 2 (B S / D) I elements of
    the activation dtype per layer (every ring step's g and u, [B S/D, I/D] each)."""
    from tsp_trainer.plan.activations import tsp_mlp_kept, tsp_selective_saved

    none = Layout("tsp", 2, micro_batch=2, tsp_recompute="none")
    assert "keep" in none.label() and "sel" not in none.label()
    for kw, match in (({"scheme": "tp"}, "tsp_recompute='none' with scheme 'tp': only tsp"),
                      ({"activation_checkpointing": True}, "'none' with activation checkpointing"),
                      ({"offload_activations": True}, "'none' with activation offload")):
        with pytest.raises(ValueError, match=match):
            Layout(**{"scheme": "tsp", "degree": 2, "tsp_recompute": "none", **kw})
    flags = {m: (Layout("tsp", 2, tsp_recompute=m).keeps_attention, Layout("tsp", 2, tsp_recompute=m).keeps_mlp)
             for m in ("full", "selective", "none")}
    assert flags == {"full": (False, False), "selective": (True, False), "none": (True, True)}
    sel = Layout("tsp", 2, micro_batch=2, tsp_recompute="selective")
    s = 4096
    assert tsp_selective_saved(SMALL, none, s, BF16) == tsp_selective_saved(SMALL, sel, s, BF16) > 0
    assert tsp_mlp_kept(SMALL, none, s, BF16) == 2 * (2 * s // 2) * SMALL.intermediate_size * 2
    assert tsp_mlp_kept(SMALL, sel, s, BF16) == tsp_mlp_kept(SMALL, Layout("tsp", 2), s, BF16) == 0
    a_sel, a_none = (activation_memory(SMALL, lay, s, BF16) for lay in (sel, none))
    assert a_none.stored_per_layer - a_sel.stored_per_layer == tsp_mlp_kept(SMALL, none, s, BF16)
    assert a_none.terms["tsp_mlp_kept"] == tsp_mlp_kept(SMALL, none, s, BF16)


def test_tsp_kv_traffic_overlaps_but_for_one_item_per_layer():
    """TSP's K/V all-gathers and dK/dV reduce-scatters run one item ahead: with 8 items per layer
    (D 8 x 1 bucket) 1/8 of their time is exposed, the rest overlaps compute; the other exposed
    tags (norm gradients, loss count) stay exposed."""
    hw, cfg = get_profile("h100"), model_config("7b")
    p = predict(cfg, Layout("tsp", 8), 131072, hw)

    def seconds(v, op):
        return v["bytes"] * WIRE_FACTOR[op](v["group"]) / (hw.intra_node_bw * 0.75) + v["count"] * 15e-6

    kv = other = 0.0
    for key, v in p.comm_mp.items():
        op, tag = key.split("/", 1)
        if tag in ("attn.kv", "attn.dkv"):
            kv += seconds(v, op)
        elif tag not in OVERLAPPABLE_TAGS:
            other += seconds(v, op)
    assert kv > 0 and other > 0
    assert p.times["exposed_comm_per_micro"] == pytest.approx(other + kv / 8)
    assert p.times["overlappable_comm_per_micro"] > 7 / 8 * kv


def test_prediction_time_model():
    hw = get_profile("h100")
    cfg = model_config("7b")
    lay = Layout("tsp", 8, dp=2, zero_stage=1, micro_batch=1, grad_accum=2)
    fast = predict(cfg, lay, 32768, hw)
    slow = predict(cfg, lay, 32768, hw, assumptions=Assumptions(compute_efficiency=0.2))
    assert slow.step_time > fast.step_time
    assert fast.tokens_per_s == pytest.approx(2 * 2 * 32768 / fast.step_time)
    assert fast.tokens_per_s_per_gpu == pytest.approx(fast.tokens_per_s / 16)
    # HFU stays under the best kernel family's achieved fraction (GEMM, plan/efficiency.py)
    assert 0 < fast.mfu < fast.hfu < KERNEL_EFFICIENCY["h100"].gemm
    assert 0 < slow.mfu < slow.hfu < 0.2
    assert fast.times["micro_step"] >= fast.times["compute_per_micro"]
    # the same layout across nodes (D = 16 > 8 GPUs per node) moves its K/V over the NIC
    wide = predict(cfg, Layout("tsp", 16, dp=1, grad_accum=4), 32768, hw)
    narrow = predict(cfg, Layout("tsp", 8, dp=2, grad_accum=2), 32768, hw)
    assert wide.times["exposed_comm_per_micro"] / wide.times["compute_per_micro"] > \
        narrow.times["exposed_comm_per_micro"] / narrow.times["compute_per_micro"]


# -- search and ranking -------------------------------------------------------------------------------

def test_candidates_respect_shapes_and_batch():
    rejected = {}
    lays = candidate_layouts(model_config("7b"), seq_len=131072, global_batch=8, world=8, rejected=rejected)
    assert lays and all(lay.world == 8 and lay.micro_batch * lay.grad_accum * lay.dp == 8 for lay in lays)
    assert {lay.scheme for lay in lays} == {"tsp", "tp", "tp_sp", "sp", "tp_x_sp"}
    assert all(lay.zero_stage == 0 for lay in lays if lay.dp == 1)


def test_at_128k_on_one_h100_node_tsp_fits_where_sp_does_not():
    """One replica on 8 GPUs (global batch 1 -> DP = 1, D = 8, the paper's single-node setting):
    SP replicates the whole model state (16 B/param), TSP holds 1/8 of it."""
    result = plan(model_config("7b"), seq_len=131072, global_batch=1, hw=get_profile("h100"), nodes=1)
    best = result.best_per_scheme()
    assert {p.layout.degree for p in result.candidates} == {8}
    assert best["tsp"].fits and not best["sp"].fits
    assert best["sp"].memory["params"] == 2 * model_config("7b").num_params()   # a full bf16 replica
    in_hbm = [p for p in result.candidates if not p.layout.offload_activations]
    tsp8 = [p for p in in_hbm if p.fits and p.layout.scheme == "tsp" and p.layout.degree == 8]
    tp8 = [p for p in in_hbm if p.layout.scheme == "tp" and p.layout.degree == 8]
    assert min(p.memory["total"] for p in tsp8) < min(p.memory["total"] for p in tp8) / 2
    ranked = [p.tokens_per_s for p in result.fitting]
    assert ranked == sorted(ranked, reverse=True)


def test_plan_errors():
    with pytest.raises(PlanError, match=r"nothing fits: the smallest layout.*needs"):
        plan(model_config("7b"), seq_len=16777216, global_batch=1, hw=get_profile("h100"), nodes=1)
    # at 4M only offloading layouts fit in HBM (checkpointed ones with a lean replay); per-block
    # checkpoints pin 1.2 TB of host memory per node (32 block inputs of 4.3 GB per GPU, the
    # checkpoint staging, AdamW's state), more than a 1 TB node has, so nesting is weighed: k = 2
    # keeps 16 of them and fits; a 300 GB node holds no nesting's inputs either
    fits = plan(model_config("7b"), seq_len=4194304, global_batch=1,
                hw=get_profile("h100", host_memory_gb=1000), nodes=1).fitting[0]
    assert fits.layout.checkpoint_segment_blocks == 2 and fits.memory["host_per_node"] < 1000e9
    with pytest.raises(PlanError, match=r"nothing fits: the layouts that fit in HBM pin too much host "
                                        r"memory; the smallest, tsp .* AC .*keep=.*nest=4 .*offload, needs "
                                        r"472 GB per node, more than the 300 GB"):
        plan(model_config("7b"), seq_len=4194304, global_batch=1,
             hw=get_profile("h100", host_memory_gb=300), nodes=1)
    with pytest.raises(PlanError, match=r"--global-batch=3 .*multiple of the data-parallel degree"):
        plan(model_config("7b"), seq_len=4096, global_batch=3, hw=get_profile("h100"), nodes=4,
             max_degree=8)


# -- CLI ----------------------------------------------------------------------------------------------

def test_cli_table_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "plan.json", tmp_path / "plan.png"
    code = cli.main(["--model", "7b", "--seq-len", "131072", "--global-batch", "1", "--gpu", "h100",
                     "--nodes", "1", "--json", str(out_json), "--plot", str(out_png), "--top", "5"])
    assert code == 0
    text = capsys.readouterr().out
    assert "tok/s/GPU" in text and "best layout per scheme" in text and "NO    sp" in text
    doc = json.loads(out_json.read_text())
    assert doc["request"]["world_size"] == 8 and len(doc["ranked"]) == 5
    assert doc["ranked"][0]["tokens_per_s"] >= doc["ranked"][-1]["tokens_per_s"]
    assert doc["best_per_scheme"]["sp"]["fits"] is False
    assert out_png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("mode,lighter,marker", [("selective", "full", " sel "), ("none", "selective", " keep ")])
def test_plan_with_kept_activations(capsys, mode, lighter, marker):
    """tsp-plan --tsp-recompute selective | none: TSP layouts keep their activations and run
    without AC (the trainer refuses the pair); each mode needs more memory than the one that keeps
    less and is predicted faster (selective: no attention recompute; none: no gate/up recompute
    either, its kept MLP bytes 2 e n I per layer); the baselines are unchanged; the CLI prints the
    mode and its marker."""
    from tsp_trainer.plan.search import candidate_layouts

    kw = dict(seq_len=32768, global_batch=8, world=8)
    layouts = candidate_layouts(SMALL.replace(max_seq_len=32768), tsp_recompute=(mode,), **kw)
    tsp = [lay for lay in layouts if lay.scheme == "tsp"]
    assert tsp and all(lay.keeps_attention and not lay.activation_checkpointing for lay in tsp)
    assert all(lay.keeps_mlp == (mode == "none") for lay in tsp)
    assert all(lay.tsp_recompute == "full" for lay in layouts if lay.scheme != "tsp")
    hw, cfg = get_profile("h100"), model_config("7b")
    less = predict(cfg, Layout("tsp", 8, tsp_recompute=lighter), 32768, hw)
    more = predict(cfg, Layout("tsp", 8, tsp_recompute=mode), 32768, hw)
    assert more.memory["total"] > less.memory["total"] and more.step_time < less.step_time
    expected_mlp = 2 * 2 * (32768 // 8) * cfg.intermediate_size if mode == "none" else 0
    assert more.activation.terms.get("tsp_mlp_kept", 0) == expected_mlp
    assert cli.main(["--model", "7b", "--seq-len", "32768", "--global-batch", "1", "--gpu", "h200",
                     "--schemes", "tsp", "--tsp-recompute", mode]) == 0
    out = capsys.readouterr().out
    assert f"TSP recompute {mode}" in out and marker in out


def test_cli_optimizer_offload(capsys):
    """tsp-plan --zero-offload-optimizer cpu: every layout offloads (ZeRO 1 or 2), the header says
    so and a note gives the host memory and the CPU / PCIe seconds of the top layout."""
    argv = ["--model", "llama3_8b", "--seq-len", "65536", "--global-batch", "8", "--gpu", "h100",
            "--schemes", "tsp", "--top", "3"]
    assert cli.main(argv + ["--zero-offload-optimizer", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "AdamW offloaded to the host (ZeRO-Offload)" in out
    assert "GB pinned host memory per node" in out and "of CPU Adam and" in out
    assert cli.main(argv) == 0
    plain = capsys.readouterr().out
    assert "AdamW offloaded" not in plain and "of CPU Adam and" not in plain


@pytest.mark.parametrize("argv,match", [
    (["--global-batch", "1", "--seq-len", "16777216", "--gpu", "h100"], r"nothing fits"),
    (["--global-batch", "3", "--seq-len", "4096", "--nodes", "4", "--max-degree", "8"],
     r"--global-batch=3 sequences.*multiple of the data-parallel degree"),
    (["--seq-len", "4096"], r"--global-batch .* is required"),
    (["--global-batch", "8", "--gpu", "a100"], r"--gpu='a100' is not a known profile"),
    (["--global-batch", "8", "--model", "70b"], r"--model='70b' is neither a named size"),
    (["--global-batch", "8", "--schemes", "tsp,ring"], r"--schemes='tsp,ring'"),
    (["--global-batch", "8", "--efficiency", "1.5"], r"--efficiency=1.5 must be in \(0, 1\]"),
    (["--global-batch", "8", "--nodes", "0"], r"--nodes=0 must be >= 1"),
    (["--dry-run", "--nodes", "1", "--degree", "3"], r"--degree=3 must divide the world size 8"),
    (["--dry-run", "--degree", "8", "--head-buckets", "3"], r"tsp: parallel.head_buckets=3"),
    (["--dry-run", "--tsp-recompute", "selective"],
     r"--tsp-recompute=selective needs --no-activation-checkpointing"),
    (["--dry-run", "--tsp-recompute", "none"],
     r"--tsp-recompute=none needs --no-activation-checkpointing .* refuses none with"),
    (["--global-batch", "8", "--tsp-recompute", "partial"], r"invalid choice: 'partial'"),
    (["--dry-run", "--zero-offload-optimizer", "cpu"],
     r"--zero-offload-optimizer=cpu is not modelled by --dry-run"),
])
def test_cli_errors_exit_2_with_a_clear_message(argv, match, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "tsp-plan: error:" in err
    assert __import__("re").search(match, err), err
