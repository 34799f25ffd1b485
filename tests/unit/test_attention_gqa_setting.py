"""train.attention_gqa: CUDA's flash route under GQA runs SDPA's fused GQA call (fused) or the
GQA-native per-group-member calls (native, model/attention_gqa.py). The setting reaches every
attention call's route; the planner models both (native's transients and measured slowdown,
fused's dK/dV per query head); `auto` takes fused wherever it fits and native only when memory
needs it, decided once, and writes fused where the path changes nothing (CPU, fp32, no GQA)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tsp_trainer.config import load_config, model_config
from tsp_trainer.model import Transformer, layers
from tsp_trainer.model.attention_kernel import Choice
from tsp_trainer.model.attention_route import SdpaRoute, sdpa_route
from tsp_trainer.plan.auto import Budget, choose_memory_settings, run_layout
from tsp_trainer.plan.efficiency import GQA_NATIVE_SLOWDOWN, gqa_native_slowdown_at
from tsp_trainer.plan.flops import executed_by_family
from tsp_trainer.plan.hardware import get_profile
from tsp_trainer.plan.layout import GQA_PATHS, Layout
from tsp_trainer.plan.precision import BF16, FP32
from tsp_trainer.plan.predict import compute_seconds_per_token, efficiencies, predict
from tsp_trainer.plan.reserved import flash_gqa_dkv_expanded_bytes, reserved_memory
from tsp_trainer.plan.resolve import resolve_run
from tsp_trainer.plan.search import gqa_paths, memory_variants

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"
SEQ = 131072
# llama3_8b on one TSP group of 8 (bf16, CUDA's route), every memory key but the GQA path fixed
RUN = ["model.size=llama3_8b", "parallel.tsp_degree=8", f"data.seq_len={SEQ}", "data.micro_batch_size=1",
       "train.grad_accum=1", "train.dtype=bf16", "train.activation_checkpointing=true",
       "parallel.tsp_recompute=full", "parallel.head_buckets=1", "train.checkpoint_segment_blocks=1",
       "train.offload_activations=false", "parallel.checkpoint_replay_keeps=all"]


@pytest.mark.parametrize("dtype,head_dim,path,expected", [
    (torch.bfloat16, 128, "native", SdpaRoute("flash", gqa_native=True)),
    (torch.bfloat16, 128, "fused", SdpaRoute("flash")),                  # SDPA's enable_gqa call
    (torch.bfloat16, 100, "native", SdpaRoute("flash")),                 # no native calls: padded d
    (torch.float32, 128, "native", SdpaRoute("efficient", expand_kv=True)),
    (torch.float32, 128, "fused", SdpaRoute("efficient", expand_kv=True)),
])
def test_the_flash_route_under_gqa_takes_the_runs_path(dtype, head_dim, path, expected):
    assert sdpa_route("cuda", dtype, gqa=True, head_dim=head_dim, gqa_path=path) == expected
    assert sdpa_route("cuda", dtype, gqa=False, head_dim=head_dim, gqa_path=path).gqa_native is False
    assert sdpa_route("cpu", dtype, gqa=True, head_dim=head_dim, gqa_path=path) == SdpaRoute("cpu_lse_merge")


def test_a_path_that_is_not_one_is_refused():
    with pytest.raises(ValueError, match="gqa_path='auto' is not one of native, fused"):
        sdpa_route("cuda", torch.bfloat16, gqa=True, head_dim=128, gqa_path="auto")


def test_the_model_hands_its_gqa_path_to_every_attention_call(monkeypatch):
    seen = []
    route = layers.sdpa_route

    def recording(*args, **kwargs):
        seen.append(kwargs["gqa_path"])
        return route(*args, **kwargs)

    monkeypatch.setattr(layers, "sdpa_route", recording)
    cfg = model_config("tiny")
    ids = torch.randint(0, cfg.vocab_size, (1, 8))
    for path in GQA_PATHS:
        model = Transformer(cfg, **Choice("fa2", "test", gqa_path=path).model_kwargs())
        model.init_weights(0)
        model(ids)
        assert seen == [path] * cfg.num_layers
        seen.clear()


def test_the_measured_slowdown_is_the_committed_results():
    """GQA_NATIVE_SLOWDOWN holds the medians of experiments/gqa_native_cost.py's results at each
    length, and the planner reads it between them in log2(S)."""
    short = json.loads((RESULTS / "gqa_native_cost.json").read_text())
    runs = [{**short, "seq_len": SEQ}, *json.loads((RESULTS / "gqa_native_cost_long.json").read_text())["runs"]]
    measured = {shape: tuple((r["seq_len"], round(r["cases"][case]["ratio"]["median"], 3))
                             for r in runs if case in r["cases"])
                for shape, case in (("prefix", "tsp_item"), ("square", "ulysses_rank"))}
    assert GQA_NATIVE_SLOWDOWN == measured
    assert gqa_native_slowdown_at("prefix", SEQ // 2) == gqa_native_slowdown_at("prefix", SEQ) == 1.255
    assert gqa_native_slowdown_at("prefix", 2 * SEQ) == pytest.approx((1.255 + 1.028) / 2)
    assert gqa_native_slowdown_at("prefix", 10_000_000) == 0.992
    assert gqa_native_slowdown_at("square", 1 << 20) == 1.004


def test_the_planner_models_each_path():
    """Fused holds FA2's dK/dV per query head in the reserve and runs the attention at the fused
    rate; native holds no such term, its own buffers in the transients, and its attention takes
    the measured slowdown longer. Where the native path does not exist the two are one layout."""
    cfg, hw = model_config("llama3_8b").replace(max_seq_len=SEQ), get_profile("h200")
    lays = {p: Layout("tsp", 8, activation_checkpointing=True, attention_gqa=p) for p in GQA_PATHS}
    reserve = {p: reserved_memory(cfg, lay, SEQ, BF16, gpu="h200")["flash_gqa_dkv_expanded"]
               for p, lay in lays.items()}
    assert reserve == {"native": 0, "fused": flash_gqa_dkv_expanded_bytes(1, SEQ, 4, 1, 128, 2)}
    work = executed_by_family(cfg, lays["fused"], SEQ, bytes_per_element=2, chunks=lays["fused"].chunks)
    eff = efficiencies(hw)
    attention = (work["attention_forward"] / eff.attention_forward
                 + work["attention_backward"] / eff.attention_backward) / hw.peak_flops
    t = {p: compute_seconds_per_token(cfg, lay, SEQ, hw, prec=BF16) for p, lay in lays.items()}
    assert t["native"] - t["fused"] == pytest.approx((gqa_native_slowdown_at("prefix", SEQ) - 1) * attention)
    pred = {p: predict(cfg, lay, SEQ, hw) for p, lay in lays.items()}
    assert pred["native"].step_time > pred["fused"].step_time
    phases = {p: pr.activation.phases for p, pr in pred.items()}
    assert phases["native"]["forward"] > phases["fused"]["forward"]            # the native buffers
    assert pred["native"].memory["total"] < pred["fused"].memory["total"]      # ... less than dK/dV x G
    on_cpu = {p: predict(cfg, lay, SEQ, hw, device="cpu") for p, lay in lays.items()}
    assert on_cpu["native"].step_time == on_cpu["fused"].step_time
    assert on_cpu["native"].memory == on_cpu["fused"].memory
    assert gqa_paths(cfg, BF16) == ("fused", "native")
    assert gqa_paths(cfg, BF16, "cpu") == gqa_paths(cfg, FP32) == ("native",)
    assert gqa_paths(model_config("tiny").replace(num_kv_heads=model_config("tiny").num_heads), BF16) == ("native",)


def _peaks(cfg) -> dict[str, float]:
    model = cfg.model.to_model_config()
    return {lay.attention_gqa: predict(model, lay, SEQ, get_profile("h200"), prec=BF16).memory["total"]
            for lay in memory_variants(model, run_layout(cfg, 8), recompute=("full",), checkpointing=(True,),
                                       buckets=(1,), gqa=GQA_PATHS)}


def test_auto_takes_fused_where_it_fits_and_native_only_where_memory_needs_it():
    cfg = load_config(None, RUN)
    peak = _peaks(cfg)
    assert peak["native"] < peak["fused"]                                       # the premise

    def chosen(budget: float, run=cfg):
        return choose_memory_settings(run, world_size=8, budget=Budget(budget, "train.memory_budget_gib"),
                                      cuda=True, hw=get_profile("h200"))

    roomy = chosen(peak["fused"])
    assert roomy.attention_gqa == "fused" and roomy.line().startswith("auto: ")
    assert "checkpoint_segment_blocks=1, attention_gqa=fused (predicted peak" in roomy.line()
    assert roomy.apply(cfg).train.attention_gqa == "fused"
    tight = chosen((peak["native"] + peak["fused"]) / 2)
    assert tight.attention_gqa == "native" and "attention_gqa=native" in tight.line()
    assert tight.apply(cfg).train.attention_gqa == "native"
    # an explicit value stays as written, and is not named as auto's
    explicit = chosen(peak["fused"], load_config(None, [*RUN, "train.attention_gqa=native"]))
    assert explicit.attention_gqa == "native" and "attention_gqa" not in explicit.line()


def test_where_the_path_changes_nothing_auto_writes_fused_without_weighing_it():
    """A CPU run (and fp32 on CUDA) has no GQA-native path to weigh: with every other key
    explicit nothing is auto, no start-up line, and the run takes fused."""
    resolved = resolve_run(load_config(None, RUN), world_size=8, cuda=False)
    assert resolved.memory is None and resolved.line() is None
    assert resolved.cfg.train.attention_gqa == "fused"
    explicit = resolve_run(load_config(None, [*RUN, "train.attention_gqa=native"]), world_size=8, cuda=False)
    assert explicit.cfg.train.attention_gqa == "native"


def test_tsp_plan_ranks_fused_first_at_128k():
    from tsp_trainer.plan.search import plan

    result = plan(model_config("llama3_8b").replace(max_seq_len=SEQ), seq_len=SEQ, global_batch=1,
                  hw=get_profile("h200"), nodes=1, schemes=("tsp",))
    assert result.fitting[0].layout.attention_gqa == "fused"
    assert "gqa=fused" in result.fitting[0].layout.label()
    assert {p.layout.attention_gqa for p in result.candidates} == set(GQA_PATHS)
