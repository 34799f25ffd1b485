"""`tsp-plan --dry-run`: the real model and TSP / TP / TP+SP schedules for the 7B recipe at world
1,024 (DP 128 x D 8) on fake tensors and the fake process group, in one process (a subprocess here,
so the fake default process group never touches the pytest process).

The ledger of one step must equal the analytic communication model exactly; saved activations
must agree to 1% and the peak to 10% (plan/activations.py, device="cpu": the fake tensors take
the CPU attention path), and the executed FLOPs torch's FLOP counter counts to the planner's
hardware FLOPs within 2% (plan/flops.py).

At the planner's longest TSP sequence for Llama-3.1-8B on one 8-GPU node (`dry_run_at_longest`:
the length and layout the planner reports, taken from it when the test runs), the dry run's
device peak (measured tensors + the planner's reserve) must fit the usable HBM and agree with the
planner's peak to 10%."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict

import pytest

from tsp_trainer.config import ModelConfig
from tsp_trainer.config.model import model_config
from tsp_trainer.plan.hardware import HardwareProfile, get_profile
from tsp_trainer.plan.longest import longest_seq_len


def _dry_run(tmp_path, *args: str, timeout: int) -> dict:
    out = tmp_path / "dry.json"
    proc = subprocess.run([sys.executable, "-m", "tsp_trainer", "plan", "--dry-run", "--json", str(out),
                           *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "equals the analytic model exactly: True" in proc.stdout
    return json.loads(out.read_text())


def _check(report: dict, schemes=("tsp", "tp", "tp_sp")) -> None:
    cfg = model_config("7b")
    assert (report["world_size"], report["degree"], report["dp"]) == (1024, 8, 128)
    assert set(report["schemes"]) == set(schemes)
    for scheme, r in report["schemes"].items():
        assert r["comm_equals_model"], (scheme, r["comm_diff"])
        assert r["param_count"] == r["param_count_model"]
        shapes = r["param_shapes"]
        # Megatron 1-D split of every matrix over the 8 ranks (TSP and TP alike), norms replicated
        assert shapes["layers.0.self_attn.q_proj.weight"] == [cfg.hidden_size // 8, cfg.hidden_size]
        assert shapes["layers.0.mlp.down_proj.weight"] == [cfg.hidden_size, cfg.intermediate_size // 8]
        assert shapes["embed_tokens.weight"] == [cfg.vocab_size // 8, cfg.hidden_size]
        assert shapes["norm.weight"] == [cfg.hidden_size]
        assert r["activations_stored"] == pytest.approx(r["activations_stored_model"], rel=0.01)
        assert r["activations_peak"] == pytest.approx(r["activations_peak_model"], rel=0.10)
        # executed FLOPs: torch's FLOP counter on the real code against the planner's formula
        flops = r["flops_per_token"]
        assert flops["counted"] == pytest.approx(flops["formula"], rel=0.02)
        assert flops["counted"] > 1.2 * flops["model"]          # AC replays the blocks
    tsp, tp = report["schemes"]["tsp"], report["schemes"]["tp"]
    assert tsp["activations_stored"] * 4 < tp["activations_stored"]     # TSP shards the sequence
    assert tsp["comm"]["all_gather/attn.kv"]["count"] > 0 and "all_reduce/attn.tp" not in tsp["comm"]


@pytest.mark.slow           # ~10 s; the small-model dry runs below cover its code in the default suite
def test_dry_run_7b_16k_world_1024(tmp_path):
    """The same code paths at 16K tokens and one head bucket."""
    report = _dry_run(tmp_path, "--seq-len", "16384", "--head-buckets", "1", timeout=600)
    assert report["seq_len"] == 16384 and report["activation_checkpointing"] is True
    _check(report)


@pytest.mark.slow
def test_dry_run_7b_128k_recipe_world_1024(tmp_path):
    """The recipe (recipes/7b_128k_1024gpu.yaml): 128K tokens, 4 head buckets, AC."""
    report = _dry_run(tmp_path, timeout=1200)
    assert report["seq_len"] == 131072
    assert report["schemes"]["tsp"]["info"]["head_buckets"] == 4
    _check(report)
    # TSP at 128K: weights move ~(D-1)/D of a layer per broadcast; K/V bytes dominate
    comm = report["schemes"]["tsp"]["comm"]
    assert comm["all_gather/attn.kv"]["bytes"] > 5 * comm["broadcast/attn.weights"]["bytes"]


def test_dry_run_of_a_config_folder_with_biases(tmp_path):
    """`--model` names a Hugging Face config.json (here a small Llama with attention_bias, mlp_bias
    and llama3 RoPE scaling): the ledger equals the analytic model exactly for TSP and SP with
    every bias kind (sharded q/k/v and gate/up biases in the moving shards, replicated o/down
    biases summed like norms), and the parameter count is the model's. TSP gathers its K/V in
    chunks of 128 of its 256 local tokens (parallel.attention_chunk_tokens): two gathers per
    item and pass, the unchunked path's bytes."""
    config = {"model_type": "llama", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512,
              "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
              "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "attention_bias": True,
              "mlp_bias": True, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                 "original_max_position_embeddings": 1024},
              "rope_theta": 500000.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    report = _dry_run(tmp_path, "--model", str(tmp_path / "config.json"), "--seq-len", "1024",
                      "--degree", "4", "--nodes", "1", "--head-buckets", "1", "--schemes", "tsp,sp",
                      "--attention-chunk-tokens", "128", timeout=600)
    kv = report["schemes"]["tsp"]["comm"]["all_gather/attn.kv"]
    # forward, the checkpoint's replay, backward: 3 passes x 2 layers x 4 items x 2 chunks
    assert kv["count"] == 3 * 2 * 4 * 2 and kv["bytes"] == 3 * 2 * 4 * 1024 * 2 * 32 * 2
    for scheme, r in report["schemes"].items():
        assert r["comm_equals_model"], (scheme, r["comm_diff"])
        assert r["param_count"] == r["param_count_model"]
        assert r["activations_stored"] == pytest.approx(r["activations_stored_model"], rel=0.01)
    tsp = report["schemes"]["tsp"]
    assert tsp["param_shapes"]["layers.0.self_attn.q_proj.bias"] == [256 // 4]
    assert tsp["param_shapes"]["layers.0.self_attn.o_proj.bias"] == [256]
    # norms and the o / down biases of 2 layers: one all-reduce of (2 L + 1 + 2 L) h fp32 elements
    replicated = tsp["comm"]["all_reduce/replicated.grad"]
    assert (replicated["count"], replicated["bytes"]) == (1, (5 + 4) * 256 * 4)


def _at_longest(tmp_path, *args: str, timeout: int) -> dict:
    out = tmp_path / "longest.json"
    proc = subprocess.run([sys.executable, "-m", "tsp_trainer.plan.dry_run", "--json", str(out), *args],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def _check_at_longest(c: dict, expected_seq_len: int) -> None:
    assert c["seq_len"] == expected_seq_len
    assert c["dry_peak"] <= c["usable_hbm"]
    assert abs(c["dry_peak"] - c["plan_peak"]) / c["plan_peak"] <= 0.10
    dry, plan = c["components"]["activations_peak"]
    assert abs(dry - plan) / plan <= 0.10                 # the part the dry run measures
    for name in ("state", "host_activations"):           # both from the same parameter count
        assert c["components"][name][0] == c["components"][name][1], name


# Pairwise over GPU and layout: each GPU and each layout once (H100 with activation offload, H200
# in HBM), the two cheapest of the four; the GPU changes only the HBM the length must fit, which
# both layouts' code paths meet on either.
@pytest.mark.slow
@pytest.mark.timeout(1800)          # the dry run at millions of tokens: minutes, past the default 300 s
@pytest.mark.parametrize("gpu,offload", [("h100", True), ("h100", False)],
                         ids=["h100-activation-offload", "h100-in-hbm"])
def test_dry_run_at_the_planners_longest_llama3_8b_sequence(tmp_path, gpu, offload):
    """tsp-plan --max-seq-len's TSP length for llama3_8b on one node with optimizer offload, run
    on fake tensors at world 8 with the planner's layout (CUDA attention route, 1 and 2 layers
    extrapolated, 2 and 3 under offload, whole segments of k and 2 k layers where the planner
    nests the checkpoints)."""
    expected = longest_seq_len(model_config("llama3_8b"), "tsp", hw=get_profile(gpu), nodes=1,
                               offload=offload, offload_optimizer=True).seq_len
    assert expected > 1_000_000
    c = _at_longest(tmp_path, "--gpu", gpu, *(["--offload"] if offload else []), timeout=1800)
    _check_at_longest(c, expected)


# a 2-layer Llama-like shape on an H100 profile with 2 GB of HBM: at D = 8, as Llama-3.1-8B's,
# one K/V head and four query heads per rank (a gathered K/V bucket half the bytes of the rank's
# [N/D, h] activations) and an MLP shard narrower than h; the planner's longest TSP sequence is
# then ~0.6M tokens, its replay keeping nothing
SMALL = ModelConfig(vocab_size=1024, hidden_size=256, num_layers=2, num_heads=32, num_kv_heads=8,
                    intermediate_size=896, max_seq_len=1 << 20)
SMALL_GPU = HardwareProfile(**{**get_profile("h100").as_dict(), "hbm_bytes": 2e9})


def test_dry_run_at_the_planners_longest_sequence_of_a_small_model():
    """The same check at a reduced size for the default suite: a small model at the planner's
    longest length on a small-HBM profile (its own process: the dry run's fake process group)."""
    script = ("import json, sys; from tsp_trainer.config import ModelConfig; "
              "from tsp_trainer.plan.hardware import HardwareProfile; "
              "from tsp_trainer.plan.dry_run import dry_run_at_longest; "
              "cfg, gpu = json.loads(sys.argv[1]); "
              "json.dump(dry_run_at_longest(ModelConfig(**cfg), HardwareProfile(**gpu)), sys.stdout)")
    shapes = json.dumps([asdict(SMALL), SMALL_GPU.as_dict()])
    proc = subprocess.run([sys.executable, "-c", script, shapes], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    c = json.loads(proc.stdout)
    expected = longest_seq_len(SMALL, "tsp", hw=SMALL_GPU, nodes=1, offload_optimizer=True).seq_len
    _check_at_longest(c, expected)
