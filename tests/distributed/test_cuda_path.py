"""The CUDA path, checked with CPU processes: what a GPU run would trip over, made
visible on gloo.

- Device placement: a training step, and a whole Trainer run (construction, evaluations, sync and
  async checkpoint saves, a resume) followed by `tsp-eval` and `tsp-export`, run under a process
  group serving CPU tensors only ("cpu:gloo") while tensors created without a device in the
  compute packages land on another device (tests/helpers/devices.py), as host tensors do next to
  CUDA ones.
- Host syncs: counted per micro-step in the whole Trainer step (tsp_trainer/tools/host_sync.py).
- Precision: gradient reductions and accumulators are fp32 in a bf16 run (the ledger records each
  payload's dtype), DeepSpeed accumulates and reduces in fp32, and a bf16 run follows the fp32
  loss curve.
"""

from __future__ import annotations

import os

import pytest

import tsp_trainer
from tests.distributed.cuda_path_cases import (bf16_step_ledger, count_host_syncs,
                                               evaluate_with_host_default_elsewhere,
                                               train_and_describe_precision,
                                               train_steps_with_host_default_elsewhere,
                                               whole_run_with_host_default_elsewhere)
from tests.helpers.dist import run_on_ranks
from tsp_trainer.parallel.baselines.comm_model import expected_ledger_bytes
from tsp_trainer.parallel.tsp.comm_model import tsp_step_comm

pytestmark = pytest.mark.distributed

PACKAGE = os.path.dirname(tsp_trainer.__file__)
GQA_BUCKETS = ["parallel.tsp_degree=2", "parallel.head_buckets=2", "model.num_heads=8",
               "model.num_kv_heads=4", "checkpoint.enabled=false"]


def test_training_step_keeps_every_tensor_on_the_compute_device():
    """DP 2 x TSP 2, two micro-steps per step, under a process group that serves only CPU
    tensors, with host-default tensors of the compute code redirected to the meta device: the
    non-finite flag, its all-reduce and every block's buffers must name their device. (The old
    trainer built its flag with torch.tensor(float(...)) on the host: NCCL's "No backend type
    associated with device type cpu" at the first optimizer step.)"""
    outs = run_on_ranks(train_steps_with_host_default_elsewhere, 4,
                        ["train.steps=2", "train.grad_accum=2", "checkpoint.enabled=false"],
                        backend="cpu:gloo")
    for o in outs:
        assert o["redirected"] == []                 # no factory in the step relied on the default
        assert o["flag_device"] == o["device"] == "cpu"
        assert len(o["losses"]) == 2 and all(loss == loss for loss in o["losses"])


def test_evaluation_keeps_every_tensor_on_the_compute_device():
    """The Trainer's evaluations (loss by position with document masking, passkey over dp 2)
    under a process group serving CPU tensors only, with host-default tensors of the compute
    packages and tsp_trainer/eval redirected to the meta device: every tensor a collective gets
    names its device (a host tensor, e.g. passkey counts built without one, fails the Comm device
    guard on a GPU run: "WrongDeviceError ... is on cpu"), and the results equal the plain run's."""
    import torch

    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 1024, (4, 65), generator=gen)
    doc_ids = torch.tensor([[0] * 20 + [1] * 44, [0] * 64, [0] * 7 + [1] * 50 + [2] * 7, [0] * 64],
                           dtype=torch.int32)
    batches = [{"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                "document_ids": doc_ids}]
    outs = run_on_ranks(evaluate_with_host_default_elsewhere, 2, batches, backend="cpu:gloo")
    for o in outs:
        assert o["redirected"] == []
        assert o["guarded"] == o["plain"]
        assert o["plain"][0] > 5.0                        # a random model: about ln(1024) = 6.9
    assert outs[0]["plain"] == outs[1]["plain"]           # dp-reduced: the same on every rank


WHOLE_RUN = ["train.eval_every=2", "train.eval_batches=1", "eval.passkey_every=2",
             "eval.passkey_lengths=[128]", "eval.passkey_depths=[0,1]", "eval.passkey_samples=2",
             "eval.passkey_digits=3", "data.document_masking=true", "data.reset_positions=true",
             "checkpoint.every=1", "optim.warmup_steps=1"]


def test_whole_run_resume_eval_and_export_keep_every_tensor_on_the_compute_device(tmp_path):
    """DP 2 x TSP 2 with document masking, under a process group serving CPU tensors only and with
    host-default tensors of the compute packages redirected to the meta device, from the Trainer's
    construction on: 2 steps with eval loss by position and passkey at step 2 and a synchronous
    save at steps 1 and 2; then a second launch resumes at step 2, trains step 3 with an async
    save, runs `tsp-eval loss` and `tsp-eval passkey` on that checkpoint under TSP D = 2 x dp 2,
    and exports it. No factory relied on the host default (the construction did: the seeded
    init, and a throwaway norm weight), and the exported weights are the trained ones."""
    from safetensors.torch import load_file

    from tsp_trainer.checkpoint.hf import load_hf_state_dict
    from tsp_trainer.config import load_config

    out = str(tmp_path / "run")
    common = [f"train.output_dir={out}", *WHOLE_RUN]
    first = run_on_ranks(whole_run_with_host_default_elsewhere, 4, common + ["train.steps=2"],
                         backend="cpu:gloo")
    cli = ["--micro-batch-size", "2", "--tsp-degree", "2", "--out", str(tmp_path / "eval")]
    second = run_on_ranks(whole_run_with_host_default_elsewhere, 4,
                          common + ["train.steps=3", "train.resume=auto", "checkpoint.async_save=true",
                                     "optim.on_resume_change=recipe"],
                          [["loss", out, "--batches", "1", *cli],
                           ["passkey", out, "--lengths", "128", "--depths", "0,1", "--samples", "2",
                            "--digits", "3", *cli]], str(tmp_path / "hf"), backend="cpu:gloo")
    for o in first + second:
        assert o["redirected"] == [] and o["device"] == "cpu"
    steps = first[0]["metrics"]
    assert "eval/loss" not in steps[0] and steps[1]["eval/loss"] > 5.0       # random init: ~6.9
    assert [r[3] for r in steps[1]["eval/loss_by_position"].rows] == [5, 5, 8, 16, 32, 64, 126]
    assert steps[1]["eval/passkey_accuracy"] == 0.0          # 2 steps cannot retrieve a key
    assert [o["resumed_from"] for o in second] == [2] * 4 and len(second[0]["metrics"]) == 1
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [
        "latest", "step_00000001", "step_00000002", "step_00000003"]
    loss, passkey = second[0]["evaluations"]
    assert sum(loss.tokens) == 256 and 5.0 < sum(loss.loss_sums) / 256 < 8.0   # 2 x 2 x 64 tokens
    assert [(c.length, c.depth, c.samples) for c in passkey.cells] == [(128, 0.0, 2), (128, 1.0, 2)]
    assert loss == second[1]["evaluations"][0]                 # reduced: the same on every rank
    model_cfg = load_config(str(tmp_path / "run" / "config.yaml"), []).model.to_model_config()
    exported = load_hf_state_dict(tmp_path / "hf", model_cfg)
    trained = second[0]["weights"]
    assert sorted(exported) == sorted(trained)
    for name, weight in trained.items():
        assert exported[name].equal(weight), name
    assert len(load_file(tmp_path / "hf" / "model.safetensors")) == len(trained)


def test_host_syncs_per_micro_step_are_a_small_constant():
    """Tiny model, D = 2, 2 head buckets, GQA: the package issues at most 10 host syncs per
    micro-step (measured: 5 per optimizer step, none per micro-step), and the count does not grow
    with layers or micro-steps (a sync per layer, shard, bucket and parameter would be 239 per
    optimizer step of 2 micro-steps here, ~13,700 per micro-step for the 7B recipe)."""
    base = run_on_ranks(count_host_syncs, 2, ["train.steps=2", "train.grad_accum=2"] + GQA_BUCKETS)[0]
    deeper = run_on_ranks(count_host_syncs, 2, ["train.steps=2", "train.grad_accum=4",
                                                "model.num_layers=4"] + GQA_BUCKETS)[0]
    for run in (base, deeper):
        ours = {site: n for site, n in run["by_site"].items() if site.startswith(PACKAGE)}
        assert run["ours"] <= 10 * run["micro_steps"], ours
    assert deeper["ours"] == base["ours"], (base["by_site"], deeper["by_site"])


@pytest.mark.parametrize("scheme,options,biases", [("tsp", {"head_buckets": 1}, False), ("sp", {}, False),
                                                   ("tsp", {"head_buckets": 1}, True), ("sp", {}, True)],
                         ids=["tsp", "sp", "tsp-biases", "sp-biases"])
def test_bf16_gradient_reductions_and_accumulators_are_fp32(scheme, options, biases):
    """bf16 weights and activations move in bf16; every gradient reduction (TSP: the attention
    weight-gradient reduce, the MLP / embedding / LM-head ring accumulators, the one all-reduce of
    the norms' and replicated o/down biases' gradients; SP: the replicated weights' and norms'
    all-reduces, with biases the o/down biases') moves fp32. The ledger equals the comm model with
    2-byte weights and activations and 4-byte gradients."""
    o = run_on_ranks(bf16_step_ledger, 2, scheme, options, biases)[0]
    grad_tags = {"tsp": ("attn.wgrad", "mlp.weights.grad", "embed.weights.grad", "head.weights.grad",
                         "replicated.grad"), "sp": ("wgrad", "norm.grad")}[scheme]
    grad_tags += ("bias.grad",) if biases and scheme == "sp" else ()    # replicated o/down biases
    for tag in grad_tags:
        assert o["dtypes"][tag] == ["float32"], (tag, o["dtypes"])
    for tag, dtypes in o["dtypes"].items():
        if tag not in grad_tags and not tag.startswith("loss."):
            assert dtypes == ["bfloat16"], (tag, dtypes)
    assert o["grad_dtypes"] == ["torch.bfloat16"]
    cfg = o["cfg"]
    if scheme == "tsp":
        expected = {f"{op}/{tag}": v for (op, tag), v in tsp_step_comm(
            cfg, degree=2, batch=2, seq_len=32, weight_bytes=2, act_bytes=2).items()}
        assert o["ledger"] == expected
    else:
        got = {k: v["bytes"] for k, v in o["ledger"].items()}
        assert got == expected_ledger_bytes(cfg, "sp", degree=2, batch=2, seq_len=32, dtype_bytes=2)


def test_bf16_training_follows_the_fp32_loss_curve_with_fp32_gradient_accumulation():
    """25 steps of the tiny model, TSP D = 2, ZeRO-1 (bf16: DeepSpeed's BF16_Optimizer with fp32
    gradient buffers), then two steps with ZeRO-2 (fp32 gradient partition), in bf16 and fp32.

    Tolerance: every step's loss within 0.02 of the fp32 run, the mean gap below 0.005
    (measured 0.0025 and 0.0007 at losses of 6.0-6.9; bf16 gradient accumulation gives gaps of
    the same size: at this size the loss curve cannot tell them apart, which is why the dtypes
    are asserted). bf16 keeps 8 significant
    bits: each matmul input carries up to 0.4% relative rounding, the loss (an fp32 mean over 128
    tokens) moves by ~1e-3 per step from it, and 25 steps let the two runs drift apart by a few
    times that; 0.02 leaves a margin of 8x. A gradient path that loses a term or a scale drifts by
    more than 0.1 within a few steps at lr 3e-3."""
    common = ["train.steps=25", "checkpoint.enabled=false", "logging.log_every=100",
              "parallel.tsp_degree=2", "zero.stage=1"]
    runs = [common + ["train.dtype=fp32"], common + ["train.dtype=bf16"],
            ["train.steps=2", "checkpoint.enabled=false", "zero.stage=2", "train.dtype=bf16",
             "parallel.tsp_degree=2"]]
    # one Trainer per launch: Accelerate takes a DeepSpeed plugin once per process
    fp32, bf16, zero2 = (run_on_ranks(train_and_describe_precision, 2, [run])[0][0] for run in runs)
    assert bf16["param_dtype"] == "torch.bfloat16" and fp32["param_dtype"] == "torch.float32"
    for run in (bf16, zero2):
        assert run["grad_accum_dtype"] == run["communication_dtype"] == "torch.float32", run
    assert bf16["optimizer"] == "BF16_Optimizer" and zero2["optimizer"] == "DeepSpeedZeroOptimizer"
    gaps = [abs(a - b) for a, b in zip(fp32["losses"], bf16["losses"])]
    assert len(gaps) == 25 and max(gaps) < 0.02 and sum(gaps) / 25 < 0.005, gaps
    assert sum(bf16["losses"][12:]) / 13 < bf16["losses"][0] - 0.3      # it trains (batches vary: noisy)
