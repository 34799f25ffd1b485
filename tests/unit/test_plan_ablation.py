"""The longest-context planner against both memories (plan/longest.py, plan/predict.py) and the
ablation table (plan/ablation.py, `tsp-plan --ablation`): each technique's row is the longest
sequence with that row's switches, rows never shrink, the node's host memory is checked and named
when it binds, activation offload is planned with checkpointing too (host = L block inputs) and at
a fixed --seq-len, head buckets are searched, and `auto` tiles only where the block would be large."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from tsp_trainer.config.model import model_config
from tsp_trainer.plan import cli
from tsp_trainer.plan.ablation import STEPS, ablation, cost_at
from tsp_trainer.plan.hardware import get_profile
from tsp_trainer.plan.layout import REPLAY_KEEPS, UNTILED, Layout
from tsp_trainer.plan.longest import format_seconds, longest_seq_len, peak_breakdown
from tsp_trainer.plan.predict import predict
from tsp_trainer.plan.search import plan

H100 = get_profile("h100")
CFG = model_config("llama3_8b")


@pytest.fixture(scope="module")
def rows():
    return ablation(CFG, hw=H100)


def test_ablation_rows_never_shrink_and_each_is_the_longest_with_its_switches(rows):
    lengths = [r.longest.seq_len for r in rows]
    assert [r.step.name for r in rows] == [s.name for s in STEPS]
    assert lengths == sorted(lengths) and lengths[0] > 0
    assert lengths[5] > 2 * lengths[4]             # activation offload is the big step
    # the tiled-MLP row (loss tiled, MLP tiled, accumulators fp32), asked for directly
    mlp = longest_seq_len(CFG, "tsp", hw=H100, nodes=1, replay_keeps=("all",), segments=(1,),
                          fields={"loss_chunk_tokens": "auto", "mlp_chunk_tokens": "auto",
                                  "tiled_accumulators": False})
    assert mlp.seq_len == rows[2].longest.seq_len
    # the row with every tiling is the planner's answer with the replay keeping all and the
    # norms' outputs kept
    assert rows[3].longest.seq_len == longest_seq_len(CFG, "tsp", hw=H100, nodes=1,
                                                      replay_keeps=("all",), segments=(1,),
                                                      fields={"norm_handoff": False}).seq_len
    # the nested row is the planner's answer with both offloads and nesting searched, the replay
    # keeping all
    nested = longest_seq_len(CFG, "tsp", hw=H100, nodes=1, offload=True, offload_optimizer=True,
                             replay_keeps=("all",), fields={"norm_handoff": False})
    assert rows[6].longest.seq_len == nested.seq_len >= lengths[5]
    # the last row is the planner's answer with both offloads and every replay value (its
    # default); the lean replay is longer than the rows above it: a replay keeping nothing holds
    # none of one block's gate/up and attention items
    lean = longest_seq_len(CFG, "tsp", hw=H100, nodes=1, offload=True, offload_optimizer=True)
    assert {"all", "attention", "nothing"} == set(REPLAY_KEEPS)
    assert rows[9].longest.seq_len == lean.seq_len > rows[8].longest.seq_len
    assert rows[8].longest.seq_len >= rows[7].longest.seq_len > 2 * lengths[5]
    assert rows[7].longest.best.layout.replay_keeps == "nothing"
    # the chunked attention row gathers K/V in chunks (attention_chunk_tokens auto); the rows
    # above gather it whole; the norm handoff row, the planner's answer, no longer keeps the
    # norms' outputs (the rows above do)
    assert rows[7].longest.best.layout.attention_chunk_tokens == UNTILED
    assert rows[8].longest.best.layout.attention_chunk_tokens == "auto"
    assert not rows[8].longest.best.layout.norm_handoff and rows[9].longest.best.layout.norm_handoff
    base = rows[0].longest.best.layout
    assert base.loss_chunk_tokens == UNTILED and not base.tiled_accumulators
    assert rows[4].longest.best.layout.offload_optimizer
    last = rows[-1].longest.best
    assert last.layout.offload_activations and last.memory["host_per_node"] <= H100.host_memory_bytes


def test_a_small_host_memory_binds_and_is_named():
    """With 300 GB of host memory per node activation offload stops where the node's pinned bytes
    reach it: shorter than with the profile's 2 TB, and the answer names host memory; nesting
    the checkpoints goes further."""
    small = get_profile("h100", host_memory_gb=300)
    full = longest_seq_len(CFG, "tsp", hw=H100, nodes=1, offload=True, segments=(1,))
    tight = longest_seq_len(CFG, "tsp", hw=small, nodes=1, offload=True, segments=(1,))
    assert 0 < tight.seq_len < full.seq_len
    assert tight.bound == "host" and tight.best.memory["host_per_node"] <= 300e9
    over = predict(CFG.replace(max_seq_len=tight.seq_len + 65536), tight.best.layout,
                   tight.seq_len + 65536, small)
    assert over.exceeds == ("host",) and not over.fits
    in_hbm = longest_seq_len(CFG, "tsp", hw=small, nodes=1)
    assert in_hbm.bound == "HBM"
    # nested checkpointing (searched by default) divides the pinned block inputs: longer, nested
    nested = longest_seq_len(CFG, "tsp", hw=small, nodes=1, offload=True)
    assert nested.seq_len > tight.seq_len and nested.best.layout.checkpoint_segment_blocks > 1
    assert nested.best.memory["host_per_node"] <= 300e9


def test_offload_with_checkpointing_pins_one_block_input_per_layer():
    """Under checkpointing the offload hooks see only each block's input (model/offload.py): the
    host holds L of them, the GPU the replay of one block; without checkpointing every layer's
    saved tensors go to the host."""
    s = 1 << 20
    model = CFG.replace(max_seq_len=s)
    ac = predict(model, Layout("tsp", 8, activation_checkpointing=True, offload_activations=True), s, H100)
    plain = predict(model, Layout("tsp", 8, offload_activations=True), s, H100)
    block_input = 2 * s // 8 * CFG.hidden_size
    assert ac.memory["host_offloaded"] == CFG.num_layers * block_input
    # without checkpointing a (tiled) layer keeps its two norms' inputs and rstd, the attention
    # and the MLP holding no norm output (parallel/tsp/norm.py)
    assert plain.memory["host_offloaded"] == CFG.num_layers * 2 * (block_input + 4 * s // 8)
    staging = ac.memory["checkpoint_staging"] + ac.memory["host_optimizer"]
    assert ac.memory["host_per_node"] == 8 * (ac.memory["host_offloaded"] + staging)


def test_a_fixed_seq_len_ranks_offload_layouts():
    """At 2M tokens nothing fits in HBM on 8 x H100; tsp-plan's answer offloads."""
    result = plan(CFG.replace(max_seq_len=1 << 21), seq_len=1 << 21, global_batch=1, hw=H100, nodes=1,
                  schemes=("tsp",))
    assert result.fitting and all(p.layout.offload_activations for p in result.fitting)
    short = plan(CFG, seq_len=131072, global_batch=1, hw=H100, nodes=1, schemes=("tsp",))
    assert not short.fitting[0].layout.offload_activations      # a tie goes to keeping them


def test_head_buckets_are_searched_where_the_kv_heads_allow():
    """7B (32 K/V heads) on D = 8: 4 per shard, so 1, 2 and 4 buckets are tried and the longest
    layout takes the most (the smallest gathered K/V); Llama-3.1-8B's 8 K/V heads leave one per
    shard, so only 1."""
    r = longest_seq_len(model_config("7b"), "tsp", hw=get_profile("mi300x"), nodes=1)
    assert r.best.layout.head_buckets == 4
    assert longest_seq_len(CFG, "tsp", hw=H100, nodes=1).best.layout.head_buckets == 1


def test_auto_tiles_only_where_the_block_would_be_large():
    """At 128K on 8 ranks auto takes every local token at once in the loss and the MLP; at 7.4M
    it tiles both (the planner's terms are the blocks' own rule)."""
    lay = Layout("tsp", 8, activation_checkpointing=True)
    short = predict(CFG, lay, 131072, H100).activation.terms
    assert short["loss_chunk_tokens"] == short["mlp_chunk_tokens"] == 131072 // 8
    s = 7340032
    long = predict(CFG.replace(max_seq_len=s), lay, s, H100).activation.terms
    # 917,504 local tokens; six [m, 1,792] bf16 intermediates under 1 GiB: at most 49,932 tokens,
    # so 19 equal chunks of 48,290; the loss's fp32 [c, 16,032] block: 16,743 at most, 55 chunks of 16,682
    assert (long["mlp_chunk_tokens"], long["loss_chunk_tokens"]) == (48290, 16682)


def test_peak_breakdown_sums_to_the_peak(rows):
    for r in rows:
        b = peak_breakdown(r.longest.best)
        parts = ("params", "grads", "optimizer", "activations_kept", "activations_transient", "reserved")
        assert sum(b[k] for k in parts) == b["total"] == r.longest.best.memory["total"]


def test_cost_at_128k():
    """The planner models TSP's tiling as free (same FLOPs and ring traffic) and optimizer
    offload as its PCIe copies and CPU Adam step."""
    costs = {r["technique"]: r for r in cost_at(CFG, hw=H100)}
    assert costs["tiled MLP"]["cost"] == 0 and costs["tiled loss"]["cost"] == 0
    # the norm handoff's extra norm passes (D per consumer and pass instead of one), forced on
    # where memory does not need it: a few percent of the step
    assert 0 < costs["norm handoff"]["cost"] < 0.1, costs["norm handoff"]
    opt = costs["optimizer offload"]
    assert opt["step_time_with_s"] > opt["step_time_without_s"] > 1


def test_layout_refuses_a_bad_chunk_in_one_line():
    with pytest.raises(ValueError, match=r"^mlp_chunk_tokens=0 must be 'auto' or an integer >= 1"):
        Layout("tsp", 8, mlp_chunk_tokens=0)
    assert "loss=untiled" in Layout("tsp", 8, loss_chunk_tokens=UNTILED).label()


def test_step_times_read_as_hours_when_long():
    assert format_seconds(30) == "30.0 s" and format_seconds(600) == "10.0 min"
    assert format_seconds(5 * 3600) == "5.0 h"


def test_cli_ablation_and_host_memory_flag(tmp_path, capsys):
    out = tmp_path / "ablation.json"
    assert cli.main(["--model", "llama3_8b", "--gpu", "h100", "--nodes", "1", "--ablation",
                     "--host-memory-gb", "300", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "+ activation offload" in text and "300 GB host memory per node" in text
    doc = json.loads(out.read_text())
    assert doc["rows"][-1]["bound_by"] == "host" and doc["rows"][-1]["host_bytes_per_node"] <= 300e9
    with pytest.raises(SystemExit) as info:
        cli.main(["--ablation", "--host-memory-gb", "0"])
    assert info.value.code == 2
    assert "--host-memory-gb=0.0 must be > 0" in capsys.readouterr().err


def test_the_planners_offloaded_bytes_under_checkpointing_are_what_the_hooks_move():
    """A real forward on CPU (fp32, one process) with activation offload around checkpointed
    blocks: the host holds exactly one block input per layer, the planner's host bytes."""
    import torch

    from tsp_trainer.model import Transformer
    from tsp_trainer.model.activation_checkpoint import checkpointed_block
    from tsp_trainer.model.offload import ActivationOffload
    from tsp_trainer.plan.activations import activation_memory
    from tsp_trainer.plan.precision import PRECISIONS

    cfg, s = model_config("tiny"), 64
    model = Transformer(cfg)
    model.init_weights(0)
    offload = ActivationOffload(checkpointed_block)
    model.block_wrapper = offload
    ids = torch.randint(0, cfg.vocab_size, (1, s), generator=torch.Generator().manual_seed(0))
    model.loss(ids, ids)
    planned = activation_memory(cfg, Layout("tsp", 1, activation_checkpointing=True,
                                            offload_activations=True), s, PRECISIONS["fp32"], device="cpu")
    assert offload.host_bytes == planned.host == cfg.num_layers * s * cfg.hidden_size * 4


def test_the_auto_settings_plan_with_the_runs_own_chunks():
    """plan/auto.py's layout of a run carries its parallel.mlp_chunk_tokens / loss_chunk_tokens,
    so a forced chunk is the one the predicted peak (which the resolver compares with the budget)
    counts."""
    from tsp_trainer.config import load_config
    from tsp_trainer.plan.auto import run_layout
    from tsp_trainer.plan.precision import FP32

    base = ["model.size=1b", "parallel.tsp_degree=2", "data.seq_len=8192", "data.micro_batch_size=1",
            "train.grad_accum=1", "parallel.head_buckets=1"]
    auto = run_layout(load_config(None, base), 2)
    forced = run_layout(load_config(None, [*base, "parallel.mlp_chunk_tokens=512"]), 2)
    assert (auto.mlp_chunk_tokens, forced.mlp_chunk_tokens) == ("auto", 512)
    model = load_config(None, base).model.to_model_config()
    chunks = [predict(model, lay, 8192, H100, prec=FP32, device="cpu").activation.terms["mlp_chunk_tokens"]
             for lay in (auto, forced)]
    assert chunks == [4096, 512]


def test_nesting_pins_one_block_input_per_segment_and_costs_the_extra_forward():
    """checkpoint_segment_blocks = k: ceil(L / k) block inputs kept, and the segment being
    backpropagated regains up to k - 1 more: with offload on the host, which holds at the most
    the kept inputs not yet used plus those regained (L = 32: 8 + 3 at k = 4; 11 + 1 at k = 3,
    whose last segment has 2 blocks, or 10 + 2 before it), the GPU's backward as per-block
    checkpointing's; without offload on the GPU, k - 1 more there. The step runs L - ceil(L / k)
    more block forwards (the FLOP model's re-runs, the step time)."""
    from tsp_trainer.plan.flops import forward_runs, recompute_runs

    s = 1 << 20
    model = CFG.replace(max_seq_len=s)
    block_input = 2 * s // 8 * CFG.hidden_size
    base = Layout("tsp", 8, activation_checkpointing=True, offload_activations=True)
    per_block = predict(model, base, s, H100)
    in_hbm = predict(model, replace(base, offload_activations=False), s, H100)
    for k, kept, host in ((3, 11, 12), (4, 8, 11)):
        nested = predict(model, replace(base, checkpoint_segment_blocks=k), s, H100)
        assert nested.memory["host_offloaded"] == host * block_input
        assert nested.activation.terms["kept_block_inputs"] == kept
        assert nested.activation.phases["backward"] == per_block.activation.phases["backward"]
        nested_in_hbm = predict(model, replace(in_hbm.layout, checkpoint_segment_blocks=k), s, H100)
        assert nested_in_hbm.activation.phases["backward"] - in_hbm.activation.phases["backward"] == \
            (k - 1 - (32 - kept)) * block_input                  # k - 1 regained, L - kept not kept
        extra = recompute_runs(CFG, nested.layout, s)["qkv"] - recompute_runs(CFG, base, s)["qkv"]
        assert extra == pytest.approx((CFG.num_layers - kept) / CFG.num_layers)
        assert nested.step_time > per_block.step_time
    assert forward_runs(base, cfg_layers=CFG.num_layers) == forward_runs(base)     # k = 1: unchanged
    with pytest.raises(ValueError, match="checkpoint_segment_blocks=2"):
        Layout("tsp", 8, checkpoint_segment_blocks=2)                          # no checkpointing
    assert "nest=4" in Layout("tsp", 8, activation_checkpointing=True, checkpoint_segment_blocks=4).label()
