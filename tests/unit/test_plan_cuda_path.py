"""The dry run's CUDA attention path (plan/dry_run.py, attention="cuda") against the planner's
CUDA variant (plan/activations.py, device="cuda"): the real code on fake tensors takes the route
it takes on a GPU (fused kernel, no mask; K/V expanded for fp32 + GQA), each fused SDPA call
allocating what the kernel allocates. Saved activations agree to 1% and the peak to 10%, the
tolerances of the CPU variant (test_plan_fake.py), and no step of the model makes the host wait
for the device."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tsp_trainer.config import ModelConfig
from tsp_trainer.model.attention_gqa import grouped_kernel_calls
from tsp_trainer.model.layers import PositionRuns, attention_core
from tsp_trainer.plan.activations import activation_memory
from tsp_trainer.plan.layout import Layout
from tsp_trainer.plan.precision import BF16, FP32
from tsp_trainer.plan.dry_run import cuda_attention_path, run_step

GQA = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=4,
                  intermediate_size=128, max_seq_len=4096)
SEQ = 1024


@pytest.mark.parametrize("scheme,degree,kw,dtype,ac", [
    ("tsp", 2, {"head_buckets": 2}, "bf16", True),     # the recipe's shape of step: flash, AC
    ("tsp", 2, {"head_buckets": 2}, "fp32", True),     # memory-efficient kernel, K/V expanded
    ("sp", 2, {}, "bf16", False),
    # selective recompute: flash's saved output + log-sum-exp kept per item, K/V views dropped
    ("tsp", 2, {"head_buckets": 2, "tsp_recompute": "selective"}, "bf16", False),
    ("tsp", 4, {"head_buckets": 1, "tsp_recompute": "selective"}, "bf16", False),
    # no recompute: selective's kept items + every ring step's gate/up pre-activations
    ("tsp", 2, {"head_buckets": 2, "tsp_recompute": "none"}, "bf16", False),
], ids=["tsp-bf16-AC", "tsp-fp32-AC", "sp-bf16", "tsp-bf16-selective", "tsp-D4-bf16-selective",
        "tsp-bf16-none"])
def test_cuda_attention_path_matches_the_planners_cuda_variant(scheme, degree, kw, dtype, ac):
    prec, torch_dtype = (BF16, torch.bfloat16) if dtype == "bf16" else (FP32, torch.float32)
    res = run_step(GQA, scheme, world_size=2 * degree, degree=degree, seq_len=SEQ, dtype=torch_dtype,
                   activation_checkpointing=ac, rank=0, attention="cuda", **kw)
    layout = Layout(scheme, degree, dp=2, activation_checkpointing=ac, head_buckets=kw.get("head_buckets", 1),
                    tsp_recompute=kw.get("tsp_recompute", "full"))
    cuda = activation_memory(GQA, layout, SEQ, prec, device="cuda")
    assert cuda.stored == pytest.approx(res.stored_bytes, rel=0.01)
    assert cuda.peak == pytest.approx(res.peak_bytes, rel=0.10)
    assert res.host_syncs == {} and res.info["attention"] == "cuda"


def test_selective_is_not_modelled_where_the_trainer_refuses_it():
    """fp32 + GQA on CUDA expands K/V into copies that selective recompute would keep: the trainer
    refuses it (parallel/tsp/recompute_rules.py), and so does the planner's CUDA variant; bf16
    and the CPU variant are modelled."""
    layout = Layout("tsp", 2, head_buckets=2, tsp_recompute="selective")
    with pytest.raises(ValueError, match="tsp_recompute='selective' on CUDA in fp32 with GQA"):
        activation_memory(GQA, layout, SEQ, FP32, device="cuda")
    assert activation_memory(GQA, layout, SEQ, BF16, device="cuda").peak > 0
    assert activation_memory(GQA, layout, SEQ, FP32, device="cpu").peak > 0
    none = Layout("tsp", 2, head_buckets=2, tsp_recompute="none")
    with pytest.raises(ValueError, match="tsp_recompute='none' on CUDA in fp32 with GQA"):
        activation_memory(GQA, none, SEQ, FP32, device="cuda")


def test_cuda_path_peaks_like_the_cpu_path_and_moves_the_same_bytes():
    """SP with AC peaks in the attention backward. Neither path holds a mask (CPU: prefix and
    diagonal merged by log-sum-exp), so in bf16 with no K/V expansion the peaks are equal."""
    kw = dict(world_size=2, degree=2, seq_len=SEQ, activation_checkpointing=True, rank=0)
    cpu, cuda = (run_step(GQA, "sp", attention=att, **kw) for att in ("cpu", "cuda"))
    assert cuda.peak_bytes == cpu.peak_bytes and cuda.comm == cpu.comm


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype,expands", [(torch.bfloat16, False), (torch.float32, True)])
def test_cuda_path_builds_no_mask_and_expands_kv_only_for_the_memory_efficient_kernel(dtype, expands):
    q, k, v = (torch.zeros(1, 32, h, 8, dtype=dtype) for h in (8, 4, 4))
    runs = PositionRuns(((8, 8), (24, 8)))
    with cuda_attention_path(), _Ops() as ops:
        attention_core(q[:, :16], k, v, runs.query_runs())
    assert ("expand" in ops.names) == expands                    # repeat_interleave of the K/V heads
    assert "tril" not in ops.names                               # no mask on the CUDA route
    with _Ops() as cpu_ops:
        attention_core(q[:, :16], k, v, runs.query_runs())
    # the CPU route: no mask either (prefix + causal diagonal, merged by log-sum-exp), no expansion
    assert "tril" not in cpu_ops.names and "expand" not in cpu_ops.names
    assert "_scaled_dot_product_flash_attention_for_cpu" in cpu_ops.names


def test_attention_path_is_named():
    with pytest.raises(ValueError, match="attention='gpu' must be 'cpu' or 'cuda'"):
        run_step(GQA, "tsp", world_size=2, degree=2, seq_len=SEQ, attention="gpu")


@functools.lru_cache(maxsize=None)
def _fused_calls_per_item(activation_checkpointing: bool, tsp_recompute: str,
                          checkpoint_replay_keeps: str) -> dict[str, float]:
    """Attention passes per layer and step through the CUDA route, per item (owner, head bucket):
    TSP at D 2 with 2 head buckets, bf16, one layer (every layer issues the same calls), the
    settings passed to run_step (one run per distinct setting). An item's pass is the
    GQA-native path's kernel calls (model/attention_gqa.py) with 2 query heads per KV head: rank
    0's zigzag runs, chunks 0 and 3 of 4 (64 tokens each), against the 256 keys: chunk 0 one causal
    block (G = 2 calls), chunk 3 its prefix (1 call) and its diagonal (2): 5 calls."""
    degree, buckets, seq, cfg = 2, 2, 256, GQA.replace(num_layers=1)
    res = run_step(cfg, "tsp", world_size=degree, degree=degree, seq_len=seq, dtype=torch.bfloat16,
                   rank=0, attention="cuda", head_buckets=buckets,
                   activation_checkpointing=activation_checkpointing, tsp_recompute=tsp_recompute,
                   checkpoint_replay_keeps=checkpoint_replay_keeps)
    groups = GQA.num_heads // GQA.num_kv_heads
    c = seq // (2 * degree)
    per_pass = grouped_kernel_calls(((0, c, 0), (c, 2 * c, 3 * c)), 2 * c, seq, groups)
    assert per_pass == 5
    return {k: n / cfg.num_layers / (degree * buckets * per_pass)
            for k, n in res.info["fused_attention_calls"].items()}


@pytest.mark.parametrize("ac", [True, False], ids=["AC", "noAC"])
@pytest.mark.parametrize("mode", ["full", "selective", "none"])
def test_attention_forward_runs_twice_under_checkpointing_and_full_recompute_once_otherwise(ac, mode):
    """Fused attention calls per item: under activation checkpointing the block's replay is TSP's
    recompute, so every mode runs the forward twice (forward, replay); without it full recompute
    runs it twice (forward, backward), selective and none once. The backward kernel runs once per
    item in every case."""
    per_layer = _fused_calls_per_item(ac, mode, "all")
    forwards = 2 if ac or mode == "full" else 1
    assert per_layer == {"forward": forwards, "backward": 1}


@pytest.mark.parametrize("keeps,forwards", [("all", 2), ("attention", 2), ("nothing", 3)])
def test_checkpoint_replay_keeping_nothing_runs_the_attention_forward_a_third_time(keeps, forwards):
    """Fused attention calls per item under checkpointing: a replay that keeps the attention
    items (all, attention) serves the backward, one that keeps nothing leaves the backward to run
    the attention forward once more, as full recompute does."""
    per_layer = _fused_calls_per_item(True, "full", keeps)      # "all": the full-AC run above
    assert per_layer == {"forward": forwards, "backward": 1}
