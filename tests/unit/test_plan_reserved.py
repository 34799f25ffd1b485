"""The planner's reserve beside the tensors (plan/reserved.py): each library buffer's arithmetic
on hand-checked shapes, the reserve in a prediction's total, and the pinned host memory of a node."""

from __future__ import annotations


from tsp_trainer.config import model_config
from tsp_trainer.plan.hardware import PROFILES
from tsp_trainer.plan.layout import Layout
from tsp_trainer.plan.precision import BF16, PRECISIONS
from tsp_trainer.plan.predict import predict
from tsp_trainer.plan.report import memory_breakdown
from tsp_trainer.plan.reserved import (MiB, ReserveAssumptions, communicators, flash_dq_accum_bytes,
                                       flash_gqa_dkv_expanded_bytes, flash_split_kv_bytes,
                                       flash_split_kv_splits, nccl_buffer_bytes, reserved_memory)


def test_flash_backward_buffers():
    # dQ accumulator: queries rounded up to 128, head_dim to 32 (<= 128) or 64, fp32
    assert flash_dq_accum_bytes(1, 8192, 4, 128) == 4 * 8192 * 4 * 128
    assert flash_dq_accum_bytes(2, 100, 3, 80) == 4 * 2 * 128 * 3 * 96
    assert flash_dq_accum_bytes(1, 128, 1, 192) == 4 * 128 * 1 * 192
    # GQA: dK and dV per query head in the activation dtype; nothing without GQA
    assert flash_gqa_dkv_expanded_bytes(1, 131072, 8, 2, 128, 2) == 2 * 2 * 131072 * 8 * 128
    assert flash_gqa_dkv_expanded_bytes(1, 131072, 8, 8, 128, 2) == 0


def test_flash_split_kv_only_for_a_grid_that_leaves_sms_idle():
    # 1 x 1 head x 8192 / 64 = 128 query blocks >= 0.8 x 132 SMs: one split, no buffers
    assert flash_split_kv_splits(1, 8192, 131072, 1, 128, 132) == 1
    assert flash_split_kv_bytes(1, 8192, 131072, 1, 128, 132) == 0
    # 1 x 2 heads x 1 block = 2 < 105.6: up to min(128, 132, 4096 / 128 = 32) splits
    assert flash_split_kv_splits(1, 64, 4096, 2, 128, 132) == 32
    assert flash_split_kv_bytes(1, 64, 4096, 2, 128, 132) == 4 * 32 * 2 * 64 * (128 + 1)


def test_nccl_buffers_and_communicators():
    a = ReserveAssumptions()
    per_connection = 4 * MiB + 4_915_200 + 524_288           # Simple + LL128 + LL
    assert nccl_buffer_bytes(3, a) == 3 * 16 * 2 * per_connection
    assert nccl_buffer_bytes(1, ReserveAssumptions(nccl_channels=2, nccl_buffsize=MiB)) == \
        2 * 2 * (MiB + 4_915_200 + 524_288)
    assert communicators(Layout("tsp", 8, dp=2)) == 3      # world, tsp, dp
    assert communicators(Layout("tsp", 8, dp=1)) == 2      # no dp group
    assert communicators(Layout("tsp", 1, dp=8)) == 2      # no model-parallel group


def test_reserve_of_a_gqa_tsp_layout_and_its_place_in_the_total():
    """Llama-3-8B (32 heads, 8 KV heads, d 128) under TSP D = 8, 1 bucket, 128K: each flash call
    has 4 query heads and 1 K/V head, 8192 queries against up to 131072 keys (the GQA-native
    path's calls: 1 query head each, or 4 stacked)."""
    cfg, s = model_config("llama3_8b"), 131072
    lay = Layout("tsp", 8, dp=1)
    r = reserved_memory(cfg, lay, s, BF16, gpu="h100")
    assert r["flash_dq_accum"] == 4 * 8192 * 4 * 128
    # GQA-native calls (model/attention_gqa.py): no dK/dV per query head; the peers' FA2 holds it
    assert r["flash_gqa_dkv_expanded"] == 0
    assert r["flash_split_kv"] == 0
    assert r["nccl_buffers"] == nccl_buffer_bytes(2)
    assert r["blas_workspaces"] == 64 * MiB and r["cuda_context"] == 512 * MiB
    assert r["total"] == sum(v for k, v in r.items() if k != "total")
    fp32 = reserved_memory(cfg, lay, s, PRECISIONS["fp32"], gpu="h100")    # memory-efficient route
    assert fp32["flash_dq_accum"] == fp32["flash_gqa_dkv_expanded"] == 0
    p = predict(cfg, lay, s, PROFILES["h100"])
    m = p.memory
    assert m["reserved"] == r["total"] and m["reserved_terms"]["nccl_buffers"] == r["nccl_buffers"]
    assert m["total"] == m["params"] + m["grads"] + m["optimizer"] + m["activations_peak"] + r["total"]
    lines = memory_breakdown(p, gpus_per_node=8)
    assert f"    NCCL buffers: {r['nccl_buffers'] / 1e9:.3f} GB" in lines
