"""Executed FLOPs: the attention formulas of tools/flop_count.py against hand counts and against
real kernels' shapes, and the planner's `hardware_flops_per_token` equal (within 2%) to what torch's
FLOP counter counts when the real code runs one micro-step on fake tensors (plan/dry_run.py), for
every scheme, TSP recompute mode, activation checkpointing on and off, on the CPU attention route
(log-sum-exp merge) and the CUDA route (fused flash calls)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tsp_trainer.config import ModelConfig
from tsp_trainer.config.load import load_config
from tsp_trainer.model.attention_lse import prefix_causal_attention
from tsp_trainer.plan.dry_run import run_step
from tsp_trainer.observability.flops import flops_per_token
from tsp_trainer.plan.flops import (forward_pieces, forward_runs, hardware_flops_per_token,
                                    run_flops_layout, run_recompute)
from tsp_trainer.plan.resolve import resolve_run
from tsp_trainer.plan.layout import Layout
from tsp_trainer.tools.flop_count import ExecutedFlops, attention_flops, visible_scores

# GQA (8 query heads, 4 K/V heads) so that K/V broadcast is counted per query head
CFG = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=4,
                  intermediate_size=128, max_seq_len=4096)
SEQ = 1024


def test_visible_scores_of_each_mask():
    assert visible_scores(4, 6, None) == 24
    assert visible_scores(4, 4, "top_left") == visible_scores(4, 4, "bottom_right") == 8
    assert visible_scores(4, 10, "bottom_right") == 4 * 6 + 8         # the prefix, then the triangle
    assert visible_scores(4, 10, "top_left") == 8
    with pytest.raises(ValueError, match="causal='diagonal'"):
        visible_scores(4, 4, "diagonal")


def test_cpu_sdpa_forward_and_backward_are_counted_causal_half():
    b, h, n, d = 2, 4, 64, 16
    q, k, v = (torch.randn(b, h, n, d, requires_grad=True) for _ in range(3))
    with ExecutedFlops() as counted:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    # forward: Q K^T and P V over n^2/2 scores, 2 FLOPs per multiply-add; backward: 5 such matmuls
    assert counted.by_op["aten._scaled_dot_product_flash_attention_for_cpu"] == 2 * b * h * n * n / 2 * 2 * d
    assert counted.by_op["aten._scaled_dot_product_flash_attention_for_cpu_backward"] == \
        2 * b * h * n * n / 2 * 5 * d


def test_lse_merge_route_counts_prefix_plus_triangle():
    b, h, n, n_k, d = 1, 2, 32, 96, 8
    q = torch.randn(b, h, n, d, requires_grad=True)
    k, v = (torch.randn(b, h, n_k, d, requires_grad=True) for _ in range(2))
    with ExecutedFlops() as counted:
        prefix_causal_attention(q, k, v).sum().backward()
    vis = n * (n_k - n) + n * n / 2
    assert counted.total == attention_flops(b * h, n, n_k, d, d, causal="bottom_right", backward=False) \
        + attention_flops(b * h, n, n_k, d, d, causal="bottom_right", backward=True)
    assert counted.total == 2 * b * h * vis * (2 * d + 5 * d)


def test_fused_cuda_ops_are_counted_causal_on_fake_tensors():
    """The CUDA kernels' ops through their meta kernels: flash (bottom-right causal) and the
    memory-efficient kernel with a lower-right mask type, forward and backward."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    b, h, n, n_k, d = 1, 4, 128, 256, 16
    with FakeTensorMode():
        q = torch.empty(b, h, n, d, dtype=torch.bfloat16)
        k = torch.empty(b, h, n_k, d, dtype=torch.bfloat16)
        with ExecutedFlops() as counted:
            r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, k, 0.0, True)
            torch.ops.aten._scaled_dot_product_flash_attention_backward(
                r[0], q, k, k, r[0], r[1], r[2], r[3], r[4], r[5], 0.0, True, r[6], r[7])
            torch.ops.aten._efficient_attention_forward(q.transpose(1, 2), k.transpose(1, 2),
                                                        k.transpose(1, 2), None, None, None, None,
                                                        None, 0.0, 2, True)
    vis = n * (n_k - n) + n * n / 2
    assert counted.by_op["aten._scaled_dot_product_flash_attention"] == 2 * b * h * vis * 2 * d
    assert counted.by_op["aten._scaled_dot_product_flash_attention_backward"] == 2 * b * h * vis * 5 * d
    assert counted.by_op["aten._efficient_attention_forward"] == 2 * b * h * vis * 2 * d


CASES = [("tsp", 2, {"head_buckets": 2}), ("tsp", 2, {"tsp_recompute": "selective"}),
         ("tsp", 2, {"tsp_recompute": "none"}), ("tp", 2, {}), ("tp_sp", 2, {}), ("sp", 2, {}),
         ("tp_x_sp", 4, {"tp_degree": 2, "sp_degree": 2})]
# selective and none are refused with activation checkpointing (config/validate.py)
LAYOUTS = [(c, ac, "cpu") for c in CASES for ac in (False, True)
           if not (ac and c[2].get("tsp_recompute", "full") != "full")]
LAYOUTS += [(CASES[0], False, "cuda"), (CASES[0], True, "cuda"), (CASES[3], True, "cuda"),
            (CASES[5], False, "cuda")]
# what TSP's checkpoint replay keeps: attention re-runs gate/up in backward, nothing also the
# projections and the attention forward
LAYOUTS += [(("tsp", 2, {"checkpoint_replay_keeps": keeps}), True, route)
            for keeps in ("attention", "nothing") for route in ("cpu", "cuda")]


def _layout(scheme: str, degree: int, kw: dict, ac: bool) -> Layout:
    axes = {"tp": kw["tp_degree"], "sp": kw["sp_degree"]} if scheme == "tp_x_sp" else {}
    return Layout(scheme, degree, dp=2, activation_checkpointing=ac, head_buckets=kw.get("head_buckets", 1),
                  tsp_recompute=kw.get("tsp_recompute", "full"),
                  replay_keeps=kw.get("checkpoint_replay_keeps", "all"), **axes)


@pytest.mark.parametrize("case,ac,attention", LAYOUTS,
                         ids=[f"{c[0]}-{'-'.join(f'{k}{v}' for k, v in c[2].items())}-"
                              f"{'AC' if ac else 'noAC'}-{a}" for c, ac, a in LAYOUTS])
def test_planner_hardware_flops_equal_the_counted_flops(case, ac, attention):
    scheme, degree, kw = case
    res = run_step(CFG, scheme, world_size=2 * degree, degree=degree, seq_len=SEQ,
                   activation_checkpointing=ac, attention=attention, **kw)
    counted_per_token = res.flops * degree / SEQ          # this rank's share of the replica's tokens
    formula = hardware_flops_per_token(CFG, _layout(scheme, degree, kw, ac), SEQ)["hardware"]
    assert counted_per_token == pytest.approx(formula, rel=0.02)


def test_forward_runs_per_layout():
    assert forward_runs(Layout("tp", 2)) == dict.fromkeys(("qkv", "core", "o", "gate_up", "down", "head"), 1)
    tsp = forward_runs(Layout("tsp", 2))
    assert (tsp["qkv"], tsp["core"], tsp["o"], tsp["gate_up"], tsp["down"], tsp["head"]) == (2, 2, 1, 2, 1, 2)
    tsp_ac = forward_runs(Layout("tsp", 2, activation_checkpointing=True))
    # under checkpointing the replay is TSP's recompute: forward + replay, no third run
    assert (tsp_ac["qkv"], tsp_ac["core"], tsp_ac["o"], tsp_ac["gate_up"], tsp_ac["down"], tsp_ac["head"]) == (
        2, 2, 2, 2, 2, 2)
    runs = [forward_runs(Layout("tsp", 2, activation_checkpointing=True, replay_keeps=keeps))
            for keeps in ("attention", "nothing")]
    # a replay keeping only attention runs gate/up a third time; keeping nothing, qkv and core too
    assert [(r["qkv"], r["core"], r["o"], r["gate_up"], r["down"]) for r in runs] == [
        (2, 2, 2, 3, 2), (3, 3, 2, 3, 2)]
    assert forward_runs(Layout("tsp", 2, replay_keeps="nothing")) == tsp    # no effect without AC
    tp_ac = forward_runs(Layout("tp", 2, activation_checkpointing=True))
    assert (tp_ac["qkv"], tp_ac["down"], tp_ac["head"]) == (2, 1, 1)
    assert forward_pieces(CFG, SEQ)["core"] == 2 * CFG.num_layers * SEQ * CFG.num_heads * CFG.head_dim


def test_the_trainer_logs_the_planner_flops_of_its_layout():
    cfg = load_config(None, ["parallel.scheme=tsp", "parallel.tsp_degree=2", "parallel.head_buckets=2",
                             "parallel.tsp_recompute=selective", "train.activation_checkpointing=false"])
    layout = run_flops_layout(cfg)
    assert (layout.scheme, layout.degree, layout.head_buckets, layout.tsp_recompute) == ("tsp", 2, 2, "selective")
    recompute = run_recompute(cfg, CFG, SEQ)
    model, hardware = flops_per_token(CFG, SEQ), flops_per_token(CFG, SEQ, recompute=recompute)
    expected = hardware_flops_per_token(CFG, Layout("tsp", 2, tsp_recompute="selective"), SEQ)
    assert (model, hardware) == (expected["model"], expected["hardware"])
    assert hardware > model
    with pytest.raises(ValueError, match="resolved"):         # auto is resolved before the run is built
        run_flops_layout(load_config(None, ["parallel.scheme=tsp", "parallel.tsp_degree=2"]))


def test_the_run_flops_are_counted_once_per_length_stage():
    """plan/resolve.py counts (model, hardware) FLOPs at start for every stage of the length
    schedule, with the one count of observability/flops.py and the resolved layout's recompute."""
    cfg = load_config(None, ["model.size=tiny", "parallel.scheme=tsp", "parallel.tsp_degree=2",
                             "data.seq_len=256", "train.steps=10", "optim.warmup_steps=1",
                             "data.seq_len_schedule=[{start_step: 0, seq_len: 128}, {start_step: 5, seq_len: 256}]"])
    resolved = resolve_run(cfg, world_size=2, cuda=False)
    assert sorted(resolved.flops) == [128, 256]
    model = resolved.cfg.model.to_model_config()
    for seq in (128, 256):
        assert resolved.flops_at(seq) == (flops_per_token(model, seq),
                                          flops_per_token(model, seq, recompute=run_recompute(resolved.cfg, model, seq)))
