"""parallel.tsp_recompute=selective on CUDA: the routes whose kernel saves copies of the gathered
K/V (fp32 + GQA's expanded K/V, document masking's varlen call) are refused before any process
group, naming dtype / heads / key and what to set; the others pass. Run on CPU: the route
decision is pure (model/attention_route.py), and the device check the Trainer runs first is
called with a CUDA device that is never used."""

from __future__ import annotations

import pytest
import torch

from tsp_trainer.config.schema import TrainConfig
from tsp_trainer.model.attention_route import sdpa_route
from tsp_trainer.parallel.tsp.recompute_rules import check_selective_route
from tsp_trainer.engine.device_support import check_device_support
from tests.unit.test_config import raises, with_


def _route(dtype, gqa):
    return sdpa_route("cuda", dtype, gqa=gqa, head_dim=128)


def test_fp32_gqa_expands_kv_and_is_refused():
    message = raises("parallel.tsp_recompute='selective' on CUDA with train.dtype=fp32 and GQA "
                     "(model.num_heads=32, model.num_kv_heads=8)", check_selective_route,
                     _route(torch.float32, True), dtype="fp32", num_heads=32, num_kv_heads=8,
                     document_masking=False)
    assert "use train.dtype=bf16" in message and "parallel.tsp_recompute=full" in message


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_document_masking_varlen_is_refused(dtype):
    message = raises("parallel.tsp_recompute='selective' on CUDA with data.document_masking=true",
                     check_selective_route, _route(dtype, False), dtype=str(dtype), num_heads=32,
                     num_kv_heads=32, document_masking=True)
    assert "varlen" in message and "data.document_masking=false" in message


@pytest.mark.parametrize("dtype,gqa", [(torch.bfloat16, True), (torch.bfloat16, False),
                                       (torch.float32, False)])
def test_routes_that_save_views_pass(dtype, gqa):
    check_selective_route(_route(dtype, gqa), dtype="x", num_heads=32, num_kv_heads=8 if gqa else 32,
                          document_masking=False)
    # CPU: the lse-merge route slices, also per document segment
    check_selective_route(sdpa_route("cpu", dtype, gqa=gqa, head_dim=128), dtype="x", num_heads=32,
                          num_kv_heads=8, document_masking=True)


def _check_on_cuda(**changes) -> None:
    cfg = with_(TrainConfig(), model__num_heads=4, model__num_kv_heads=2, zero__stage=1, **changes)
    check_device_support(cfg, cfg.model.to_model_config(), device=torch.device("cuda"))


def test_trainer_refuses_before_any_process_group():
    """check_device_support (the Trainer calls it before the accelerator and the mesh exist)
    applies the rule for CUDA devices; full recompute and bf16 pass."""
    raises("parallel.tsp_recompute='selective' on CUDA with train.dtype=fp32 and GQA "
           "(model.num_heads=4, model.num_kv_heads=2)", _check_on_cuda,
           parallel__tsp_recompute="selective", train__dtype="fp32")
    raises("data.document_masking=true", _check_on_cuda, parallel__tsp_recompute="selective",
           train__dtype="bf16", data__document_masking=True)
    _check_on_cuda(parallel__tsp_recompute="selective", train__dtype="bf16")
    _check_on_cuda(parallel__tsp_recompute="full", train__dtype="fp32")


def test_trainer_applies_the_route_rules_to_recompute_none():
    """parallel.tsp_recompute=none keeps the attention kernel's graph as selective does: the
    Trainer refuses the same CUDA routes for it (fp32 + GQA, document masking on flash) and
    passes bf16 without masking."""
    raises("parallel.tsp_recompute='none' on CUDA with train.dtype=fp32 and GQA (model.num_heads=4, "
           "model.num_kv_heads=2)",
           _check_on_cuda, parallel__tsp_recompute="none", train__dtype="fp32")
    raises("parallel.tsp_recompute='none' on CUDA with data.document_masking=true",
           _check_on_cuda, parallel__tsp_recompute="none", train__dtype="bf16", data__document_masking=True)
    _check_on_cuda(parallel__tsp_recompute="none", train__dtype="bf16")
