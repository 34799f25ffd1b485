"""experiments/gpu_acceptance.py's CPU twin (--device cpu --tiny): the same code path as the H200
run at tiny sizes, so it cannot rot: (a) ours and transformers' CausalLM on the same weights and batch
(same first loss), (b) one TSP rank of D = 4 whose peers are the fake process group with copy
traffic (every op's bytes copied: equal to the ledger's), its measured peak within 10% of the
planner's CPU variant, (c) the SDPA ops found in a profiled step, classified, (d) the fields of MFU
(None on CPU: no peak FLOP/s), (e) the BF16_Optimizer step's state, (f) a packed batch of three
documents, (g) activation offload (on CPU its host copies count: the same peak); the time
budget's skip notes; the trainer's allocator settings."""

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
    assert t["degree"] == 4 and t["step_time_s"] > 0 and len(t["step_times_s"]) == 1
    assert (t["head_buckets"], t["tsp_recompute"], t["activation_checkpointing"]) == (1, "full", True)
    assert t["measured_over_planner"] == pytest.approx(1.0, abs=0.10)
    assert any("scaled_dot_product" in k for k in t["sdpa_kernels"])
    assert t["attention_kernel"] == "cpu" and set(t["attention_kernel_families"]) == {"cpu_flash"}
    assert r["peak_flops"] is None and t["mfu"] is None      # CPU: no peak, no MFU
    assert t["peak_reserved_bytes"] is None and r["allocator"] is None
    twin = t["comm_twin"]                 # every payload byte of the ledger was copied, once per op
    assert twin["copied_bytes_per_step"] == twin["ledger_bytes_per_step"] > 0
    assert twin["stream_waits_per_step"] >= twin["copies_per_step"] > 0
    assert sum(v["bytes"] for v in twin["by_op"].values()) == twin["copied_bytes_per_step"]
    opt = r["optimizer_step"]             # fp32 master + fp32 grads + two fp32 moments
    assert opt["state_bytes"] == 16 * opt["param_count"] and opt["step_time_s"] > 0
    docs = r["document_masking"]
    assert docs["document_lengths"] == [200, 150, 162] and docs["attention_kernel_families"]["cpu_flash"] > 0
    off = r["activation_offload"]         # on CPU the offloaded copies are host tensors too: the
    assert off["step_time_s"] > 0 and off["planner_peak_act_bytes"] <= t["planner_peak_act_bytes"]
    # the copies stay in host memory that the tracker sees, so offload cannot lower the tracked peak
    assert off["peak_act_bytes"] >= t["peak_act_bytes"]
    assert set(r["tsp_rank_by_kernel"]) == {"cpu"} and r["skipped"] == []


def test_budget_skips_a_part_that_does_not_fit_with_a_note():
    budget = load_experiment("gpu_acceptance").Budget(10.0)
    assert budget.allows("optimizer_step", 1.0)
    assert not budget.allows("document_masking", 20.0)
    (note,) = budget.skipped
    assert note["part"] == "document_masking" and note["estimate_s"] == 20.0
    assert "exceeds the 10 s budget" in note["note"]


def test_allocator_settings_are_the_trainers_and_a_users_are_kept():
    script = load_experiment("gpu_acceptance")
    env: dict[str, str] = {}
    got = script.apply_allocator_settings(env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"} and got["set_by_this_run"]
    env = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    got = script.apply_allocator_settings(env)
    assert got["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128" and not got["set_by_this_run"]


def test_cuda_without_a_gpu_is_a_clear_error(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(SystemExit) as info:
        load_experiment("gpu_acceptance").main(["--device", "cuda"])
    assert info.value.code == 2
    assert "no CUDA device is visible; use --device cpu --tiny" in capsys.readouterr().err


def test_bf16_master_step_is_adamw_on_fp32_masters_with_clipping():
    """(e) against torch's AdamW on fp32 copies of the same weights and (bf16) gradients, clipped
    over all of them, with tsp_trainer/optim.py's groups: same masters, bf16 weights their rounding."""
    import torch

    from tsp_trainer.config.schema import OptimSection
    from tsp_trainer.optim import param_groups

    script = load_experiment("gpu_acceptance")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).to(torch.bfloat16)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    optim = OptimSection(lr=0.1)
    step = script.Bf16MasterAdamW(model, optim, max_grad_norm=0.5)
    ref_opt = torch.optim.AdamW(param_groups(ref, optim.weight_decay), lr=optim.lr,
                                betas=(optim.beta1, optim.beta2), eps=optim.eps)
    for _ in range(2):
        for p, r in zip(model.parameters(), ref.parameters()):
            p.grad = torch.randn_like(p)
            r.grad = p.grad.float()
        step.step()
        torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 0.5)
        ref_opt.step()
    masters = torch.cat([m.detach() for _, m in step.groups])
    decay, no_decay = param_groups(ref, optim.weight_decay)
    expected = torch.cat([p.detach().flatten() for p in decay["params"] + no_decay["params"]])
    torch.testing.assert_close(masters, expected, rtol=1e-6, atol=1e-7)
    for p, r in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.detach(), r.detach().to(torch.bfloat16))
    assert step.state_bytes() == 16 * sum(p.numel() for p in model.parameters())
