"""The whole Trainer (Accelerate + DeepSpeed ZeRO over dp, TSP over tsp) on 4 CPU processes."""

import inspect
import json
import os

import pytest
import torch

from tests.distributed.trainer_cases import assert_matches_reference, reference_run, train_rank
from tests.helpers.dist import run_on_ranks

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("stage,scheme,layout", [
    (1, "tsp", []), (2, "tsp", []),
    (1, "tp", []), (1, "tp_sp", []), (1, "sp", []),
    (2, "tp_x_sp", ["parallel.tsp_degree=4", "parallel.tp_degree=2", "parallel.sp_degree=2"]),
    # every bias kind, a scaled RoPE and nested activation checkpointing with offload: the
    # grad-norm counts sharded biases once per shard and replicated ones once
    (1, "tsp", ["model.qkv_bias=true", "model.o_bias=true", "model.mlp_bias=true",
                "model.rope_scaling.rope_type=llama3", "model.rope_scaling.factor=8",
                "model.rope_scaling.low_freq_factor=1", "model.rope_scaling.high_freq_factor=4",
                "model.rope_scaling.original_max_position_embeddings=16",
                "train.activation_checkpointing=true",
                # nested checkpointing (one segment of the 2 blocks), its kept input on the host
                "train.checkpoint_segment_blocks=2", "train.offload_activations=true"]),
])
def test_dp2_tsp2_matches_single_process(stage, scheme, layout):
    """5 steps of DP=2 x TSP=2 (and of each baseline scheme on 4 ranks) equal one process on the
    same global batches, ZeRO-1 and ZeRO-2.

    Losses: rtol 1e-6 (measured 3e-7: fp32 summation order). Weights: AdamW divides by sqrt(v), so
    an element whose gradient is at the fp32 noise floor moves by up to lr in a noise-set
    direction (see tests/distributed/test_tsp_parity.py); bound lr / 30 = 1e-4 (measured 1.3e-5),
    and require 99.9% of all elements to agree to 1e-6, which a real error would break."""
    overrides = ["train.steps=5", "checkpoint.enabled=false", f"zero.stage={stage}",
                 f"parallel.scheme={scheme}"] + layout
    dp = 1 if any(k.startswith("parallel.") for k in layout) else 2
    reference = reference_run(overrides, dp_degree=dp)
    outs = run_on_ranks(train_rank, 4, overrides)
    assert outs[0]["dp_world_size"] == dp                     # ZeRO sees dp only, via the mpu
    # the clipped norm counts each shard once (tensor_model_parallel flags): same as one process
    assert_matches_reference(outs, reference)


@pytest.mark.slow
@pytest.mark.parametrize("stage,scheme,extra", [
    (2, "tsp", ["model.qkv_bias=true", "model.o_bias=true"]), (1, "tp", [])])
def test_kv_head_copies_count_once_in_the_clipped_norm(stage, scheme, extra):
    """One K/V head, copied on both ranks of the model-parallel group (DP 2 x D 2): DeepSpeed's
    clipped gradient norm counts the copy once (its tensor_model_parallel flag is set on the first
    holder only) and the losses are one process's. The copies' share of the squared norm is 6.5%
    (tsp, with biases) and 13% (tp) at step 1: counting them twice, or not at all, moves the norm
    3-6%; measured within 1.3e-5 over 5 steps (AdamW's noise-floor elements move the weights apart
    slowly: the weights are compared in tests/distributed/test_hf_shapes.py with eps 1e-3)."""
    overrides = ["train.steps=5", "checkpoint.enabled=false", f"zero.stage={stage}",
                 f"parallel.scheme={scheme}", "model.num_kv_heads=1"] + extra
    ref_losses, _, ref_norms = reference_run(overrides, dp_degree=2)
    outs = run_on_ranks(train_rank, 4, overrides)
    assert outs[0]["grad_norms"] == pytest.approx(ref_norms, rel=1e-4)
    for o in outs:
        assert o["losses"] == pytest.approx(ref_losses, rel=1e-6)


def test_selective_and_no_recompute_train_like_full():
    """parallel.tsp_recompute=selective and =none through the whole Trainer (DP 2 x TSP 2, ZeRO-1,
    4 steps): the same losses and clipped gradient norms as full recompute (rtol 1e-6: only the
    fp32 summation order may differ), and the Parallelized it built says which mode it runs."""
    overrides = ["train.steps=4", "checkpoint.enabled=false", "zero.stage=1"]
    full = run_on_ranks(train_rank, 4, overrides + ["parallel.tsp_recompute=full"], False)
    for mode in ("selective", "none"):
        kept = run_on_ranks(train_rank, 4, overrides + [f"parallel.tsp_recompute={mode}"], False)
        for f, s in zip(full, kept):
            assert s["losses"] == pytest.approx(f["losses"], rel=1e-6), mode
            assert s["grad_norms"] == pytest.approx(f["grad_norms"], rel=1e-5), mode
            assert s["recompute"] == mode and f["recompute"] == "full"
        assert kept[0]["losses"][-1] < kept[0]["losses"][0]


def test_resume_equals_uninterrupted(tmp_path):
    """An 8-step run saves every 2 steps. Resuming its step-2 checkpoint reproduces steps 3-8 bit
    for bit (losses and weights); so does a chain of two resumes (that resumed run's own step-6
    checkpoint resumed in turn)."""
    def run(out, resume="none", every=0):
        return run_on_ranks(train_rank, 4, ["train.steps=8", f"checkpoint.every={every}",
                                            "checkpoint.keep_last=10", f"train.resume={resume}",
                                            f"train.output_dir={tmp_path / out}"])[0]

    full = run("a", every=2)
    ckpt = tmp_path / "a" / "checkpoints"
    assert sorted(p.name for p in ckpt.glob("step_*")) == [f"step_{s:08d}" for s in (2, 4, 6, 8)]
    once = run("b", resume=ckpt / "step_00000002", every=2)
    assert once["losses"] == full["losses"][2:]
    for name, w in full["weights"].items():
        assert torch.equal(once["weights"][name], w), name
    twice = run("c", resume=tmp_path / "b" / "checkpoints" / "step_00000006")
    assert twice["losses"] == full["losses"][6:]
    for name, w in full["weights"].items():
        assert torch.equal(twice["weights"][name], w), name


def test_keep_last_and_auto_resume(tmp_path):
    out = tmp_path / "run"
    common = ["checkpoint.every=1", "checkpoint.keep_last=2", f"train.output_dir={out}",
              "train.resume=auto"]
    first = run_on_ranks(train_rank, 4, ["train.steps=3"] + common, False)[0]
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_00000002", "step_00000003"]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    again = run_on_ranks(train_rank, 4, ["train.steps=3"] + common, False)[0]
    assert again["losses"] == [] and again["step"] == 3 and first["step"] == 3   # nothing left to do


def test_wandb_offline_on_rank0_only(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_env"))
    out = tmp_path / "run"
    run_on_ranks(train_rank, 4, ["train.steps=3", "checkpoint.enabled=false",
                                 "logging.wandb_mode=offline", f"train.output_dir={out}"], False)
    runs = list(out.rglob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("run-*.wandb"))  # one run: rank 0's
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    for key in ("train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s",
                "perf/tokens_per_s_per_gpu", "perf/tflops_per_gpu", "perf/mfu", "mem/peak_gib",
                "comm/tsp/broadcast_bytes"):
        assert key in lines[-1], key
    assert lines[-1]["comm/tsp/broadcast_bytes"] > 0


def test_accelerate_internal_the_mpu_shim_relies_on():
    """engine/deepspeed.py binds mpu= onto deepspeed.initialize while accelerator.prepare runs;
    that works only while Accelerate looks the function up at prepare time."""
    from accelerate import Accelerator

    source = inspect.getsource(Accelerator._prepare_deepspeed)
    assert "ds_initialize = deepspeed.initialize" in source
    assert "ds_initialize(**kwargs)" in source
    assert os.environ.get("DS_ACCELERATOR") == "cpu"
