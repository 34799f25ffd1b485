"""The planner's per-kernel-family efficiency table (plan/efficiency.py): the compute time it
gives, and its recalibration from a synthetic experiments/gpu_acceptance.py report whose step
times were made from known efficiencies (the fit must recover them)."""

from __future__ import annotations

import json

import pytest

from tsp_trainer.config.model import model_config
from tsp_trainer.plan import cli
from tsp_trainer.plan.efficiency import (KERNEL_EFFICIENCY, KernelEfficiency, calibrate, gpu_of_device,
                                         kernel_efficiency, main, read_table)
from tsp_trainer.plan.flops import executed_by_family
from tsp_trainer.plan.hardware import get_profile
from tsp_trainer.plan.layout import Layout


def test_every_profile_has_a_row_and_rows_are_fractions():
    from tsp_trainer.plan.hardware import PROFILES

    assert set(KERNEL_EFFICIENCY) == set(PROFILES)
    h200 = kernel_efficiency("H200")
    assert (h200.gemm, h200.attention_forward, h200.attention_backward) == (0.803, 0.628, 0.567)
    with pytest.raises(ValueError, match="gemm=1.2 must be in"):
        KernelEfficiency(gemm=1.2, attention_forward=0.5, attention_backward=0.5, elementwise=0.8)
    with pytest.raises(ValueError, match="gpu='a100' has no kernel efficiency row"):
        kernel_efficiency("a100")


def _synthetic_report(truth: KernelEfficiency, gpu: str = "h200") -> dict:
    """A gpu_acceptance.py report (the keys it writes) whose step times follow `truth`."""
    hw = get_profile(gpu)

    def step_s(cfg, layout, seq, tokens):
        work = executed_by_family(cfg, layout, seq)
        return tokens * (work["gemm"] / (hw.peak_flops * truth.gemm)
                         + work["attention_forward"] / (hw.peak_flops * truth.attention_forward)
                         + work["attention_backward"] / (hw.peak_flops * truth.attention_backward)
                         + work["elementwise_bytes"] / (hw.hbm_bw * truth.elementwise))

    plain = step_s(model_config("1b"), Layout("tp", 1), 8192, 8192)
    tsp = step_s(model_config("7b"), Layout("tsp", 8, activation_checkpointing=True, head_buckets=4),
                 131072, 131072 // 8)
    return {"device": "NVIDIA H200", "peak_flops": hw.peak_flops, "torch": "2.13.0", "tiny": False,
            "plain": {"model": "1b", "seq_len": 8192, "dtype": "bf16",
                      "ours": {"step_time_s": plain, "tokens_per_s": 8192 / plain, "mfu": None},
                      "hf": {"step_time_s": plain * 1.1}},
            "tsp_rank": {"model": "7b", "seq_len": 131072, "degree": 8, "head_buckets": 4,
                         "dtype": "bf16", "step_time_s": tsp, "local_tokens": 131072 // 8, "mfu": None}}


def test_calibration_recovers_the_efficiencies_a_synthetic_run_was_made_with(tmp_path):
    base = kernel_efficiency("h200")
    truth = KernelEfficiency(gemm=0.62, attention_forward=0.41,
                             attention_backward=0.41 * base.attention_backward / base.attention_forward,
                             elementwise=base.elementwise)
    report = _synthetic_report(truth)
    gpu, fitted = calibrate(report)
    assert gpu == "h200"
    assert fitted.gemm == pytest.approx(0.62, abs=1e-3)
    assert fitted.attention_forward == pytest.approx(0.41, abs=1e-3)
    assert fitted.attention_backward == pytest.approx(truth.attention_backward, abs=1e-3)
    # the CLI writes the whole table with the h200 row replaced; tsp-plan reads it back
    (tmp_path / "acc.json").write_text(json.dumps(report))
    out = tmp_path / "table.json"
    assert main([str(tmp_path / "acc.json"), "--out", str(out)]) == 0
    table = read_table(out)
    assert table["h200"].gemm == pytest.approx(0.62, abs=1e-3)
    assert table["h100"] == KERNEL_EFFICIENCY["h100"]
    assert cli.main(["--model", "7b", "--seq-len", "131072", "--global-batch", "8", "--gpu", "h200",
                     "--schemes", "tsp", "--efficiency-table", str(out), "--top", "1"]) == 0


def test_calibration_refuses_a_report_faster_than_peak():
    report = _synthetic_report(kernel_efficiency("h200"))
    report["tsp_rank"]["step_time_s"] /= 10
    report["plain"]["ours"]["step_time_s"] /= 10
    with pytest.raises(ValueError, match="outside \\(0, 1\\]"):
        calibrate(report)
    del report["plain"]
    with pytest.raises(ValueError, match="key 'plain' is missing"):
        calibrate(report)


def test_gpu_of_device_names():
    assert gpu_of_device("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_of_device("AMD Instinct MI300X") == "mi300x"
    with pytest.raises(ValueError, match="device='cpu'"):
        gpu_of_device("cpu")
