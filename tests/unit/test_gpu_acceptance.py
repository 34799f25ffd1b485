"""experiments/gpu_acceptance.py's CPU twin (--device cpu --tiny): the same code path as the H200
run at tiny sizes, so it cannot rot: (a) ours and transformers' CausalLM on the same weights and batch
(same first loss), (b) one TSP rank of D = 8 whose peers are the fake process group, its measured
peak within 10% of the planner's CPU variant, (c) the SDPA ops found in a profiled step, (d) the
fields of MFU (None on CPU: no peak FLOP/s)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.experiments import load_experiment


def test_cpu_twin_writes_every_part(tmp_path):
    out = tmp_path / "acc.json"
    script = load_experiment("gpu_acceptance")
    assert script.main(["--device", "cpu", "--tiny", "--steps", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    plain, t = r["plain"], r["tsp_rank"]
    assert plain["ours"]["first_loss"] == pytest.approx(plain["hf"]["first_loss"], rel=1e-5)
    assert plain["ours"]["tokens_per_s"] > 0 and plain["ours_over_hf_tokens_per_s"] > 0
    assert t["degree"] == 8 and t["step_time_s"] > 0 and len(t["step_times_s"]) == 1
    assert t["measured_over_planner"] == pytest.approx(1.0, abs=0.10)
    assert any("scaled_dot_product" in k for k in t["sdpa_kernels"])
    assert r["peak_flops"] is None and t["mfu"] is None      # CPU: no peak, no MFU


def test_cuda_without_a_gpu_is_a_clear_error(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(SystemExit) as info:
        load_experiment("gpu_acceptance").main(["--device", "cuda"])
    assert info.value.code == 2
    assert "no CUDA device is visible; use --device cpu --tiny" in capsys.readouterr().err
