"""`auto` for parallel.tsp_recompute, train.activation_checkpointing and parallel.head_buckets
(plan/auto.py): the fastest candidate whose predicted peak fits train.memory_budget_gib, explicit
values as written, one-line refusals when nothing fits, and tsp-plan's top row as the same choice."""

from __future__ import annotations

import json

import pytest

from tsp_trainer import cli
from tsp_trainer.config import load_config
from tsp_trainer.config.schema import TrainConfig, TrainSection
from tsp_trainer.config.validate import validate_config
from tsp_trainer.plan import cli as plan_cli
from tsp_trainer.plan.auto import (GIB, AutoSettingsError, Budget, choose_auto_settings,
                                   choose_memory_settings, run_layout)
from tsp_trainer.plan.hardware import get_profile
from tsp_trainer.plan.precision import BF16, FP32
from tsp_trainer.plan.predict import Assumptions, predict
from tsp_trainer.plan.layout import REPLAY_KEEPS
from tsp_trainer.plan.search import memory_variants

# 1B at 8K tokens on D=2 (fp32, the CPU path): compute dominates the predicted step, so the modes
# that recompute less are predicted faster and need more memory
ONE_B = ["model.size=1b", "parallel.tsp_degree=2", "data.seq_len=8192", "data.micro_batch_size=1",
         "train.grad_accum=1", "parallel.head_buckets=1"]


def _cfg(*overrides: str) -> TrainConfig:
    return load_config(None, [*ONE_B, *overrides])


def _peaks(cfg: TrainConfig) -> dict[tuple[str, bool], int]:
    """(recompute mode, checkpointing) -> the planner's predicted peak (model state + activation
    peak) of each candidate, on the CPU path the resolver uses for a CPU run."""
    model = cfg.model.to_model_config()
    out = {}
    for lay in memory_variants(model, run_layout(cfg, 2), buckets=(1,)):
        p = predict(model, lay, cfg.data.seq_len, get_profile("h100"), prec=FP32, device="cpu")
        out[(lay.tsp_recompute, lay.activation_checkpointing)] = p.memory["total"]
    return out


def _resolve(budget_bytes: float, *overrides: str):
    cfg = _cfg(f"train.memory_budget_gib={budget_bytes / GIB!r}", *overrides)
    return choose_auto_settings(cfg, world_size=2, cuda=False)


def test_the_budget_decides_none_selective_or_checkpointing_with_full():
    """Budgets between the candidates' predicted peaks give, in turn: none (room for everything),
    selective (room for its kept attention, not the MLP's gate/up), full without checkpointing,
    and only checkpointing with full recompute."""
    peaks = _peaks(_cfg())
    ac, full, sel, keep = (peaks[("full", True)], peaks[("full", False)], peaks[("selective", False)],
                           peaks[("none", False)])
    assert set(peaks) == {("full", True), ("full", False), ("selective", False), ("none", False)}
    assert ac < full < sel < keep                   # the premise: less recompute, more memory

    def chosen(budget):
        c = _resolve(budget)
        return c.tsp_recompute, c.activation_checkpointing, c.head_buckets

    assert chosen(keep) == ("none", False, 1)
    assert chosen((sel + keep) / 2) == ("selective", False, 1)
    assert chosen((full + sel) / 2) == ("full", False, 1)
    assert chosen((ac + full) / 2) == ("full", True, 1)
    c = _resolve((ac + full) / 2)
    assert c.peak == ac and c.budget.bytes == pytest.approx((ac + full) / 2, rel=1e-12)


def test_explicit_values_win():
    """An explicit key stays as written; auto chooses only the others around it."""
    room = 1000 * GIB
    c = _resolve(room, "parallel.tsp_recompute=full")
    assert (c.tsp_recompute, c.activation_checkpointing) == ("full", False)
    c = _resolve(room, "train.activation_checkpointing=true")
    assert (c.tsp_recompute, c.activation_checkpointing) == ("full", True)   # the only mode AC takes
    c = _resolve(room, "parallel.tsp_recompute=selective")
    assert (c.tsp_recompute, c.activation_checkpointing) == ("selective", False)
    assert choose_auto_settings(_cfg("parallel.tsp_recompute=full", "train.activation_checkpointing=false"),
                                world_size=2, cuda=False) is None         # nothing left to choose
    # a baseline varies checkpointing alone; TSP's keys resolve to full and 1
    tp = load_config(None, ["model.size=1b", "parallel.scheme=tp", "parallel.tsp_degree=2",
                            "data.seq_len=8192", "data.micro_batch_size=1", f"train.memory_budget_gib={1000}"])
    c = choose_auto_settings(tp, world_size=2, cuda=False)
    assert (c.tsp_recompute, c.activation_checkpointing, c.head_buckets) == ("full", False, 1)


def test_nothing_fits_names_the_budget_and_the_smallest_peak():
    peaks = _peaks(_cfg())
    smallest = min(peaks.values())
    with pytest.raises(AutoSettingsError) as info:
        _resolve(smallest / 2)
    message = str(info.value)
    assert "\n" not in message and info.value.agreed
    assert f"nothing fits the memory budget of {smallest / 2 / GIB:.1f} GiB per process " \
           "(train.memory_budget_gib)" in message
    assert f"the smallest predicted peak is {smallest / GIB:.1f} GiB (tsp_recompute=full, " \
           "activation_checkpointing=true, head_buckets=1, checkpoint_replay_keeps=all, " \
           "checkpoint_segment_blocks=1)" in message


def _nested_peak(k: int, *overrides: str) -> float:
    """The predicted peak of the run's layout under full recompute and checkpointing with
    checkpoint_segment_blocks=k (the candidate `auto` weighs for k)."""
    from dataclasses import replace
    cfg = _cfg(*overrides)
    model = cfg.model.to_model_config()
    lay = replace(run_layout(cfg, 2), activation_checkpointing=True, checkpoint_segment_blocks=k)
    return predict(model, lay, cfg.data.seq_len, get_profile("h100"), prec=FP32, device="cpu").memory["total"]


def test_auto_nests_only_when_the_budget_needs_it():
    """train.checkpoint_segment_blocks=auto: per-block checkpointing (k = 1, no extra forward)
    whenever it fits; under a budget between the peaks of k = 1 and a nested k, the smallest k
    that fits; an explicit k stays as written. 1B has 16 layers: k = 4 keeps 4 block inputs, and
    regains at most 3 in backward."""
    fixed = ["parallel.tsp_recompute=full", "train.activation_checkpointing=true",
             "train.checkpoint_segment_blocks=auto"]
    per_block, nested = _nested_peak(1), _nested_peak(4)
    assert nested < per_block                            # the premise: nesting saves memory here
    roomy = _resolve(per_block * 1.01, *fixed)
    assert roomy.checkpoint_segment_blocks == 1 and roomy.activation_checkpointing
    tight = _resolve((per_block + nested) / 2, *fixed)
    assert 1 < tight.checkpoint_segment_blocks <= 4
    assert tight.peak <= (per_block + nested) / 2
    assert "checkpoint_segment_blocks=" in tight.line()
    applied = tight.apply(_cfg(*fixed))
    assert applied.train.checkpoint_segment_blocks == tight.checkpoint_segment_blocks
    explicit = _resolve(per_block * 2, "parallel.tsp_recompute=auto", "train.checkpoint_segment_blocks=2")
    assert explicit.checkpoint_segment_blocks == 2 and explicit.activation_checkpointing


def test_nesting_without_checkpointing_is_refused():
    with pytest.raises(ValueError, match="train.checkpoint_segment_blocks=2 with "
                                         "train.activation_checkpointing=false"):
        validate_config(_cfg("train.activation_checkpointing=false", "train.checkpoint_segment_blocks=2"))


def test_tsp_check_exits_2_when_nothing_fits(capsys, tmp_path):
    """`python -m tsp_trainer check` (the input checks of tsp-train) refuses a budget nothing fits
    in, with one line and exit 2, before the run folder exists."""
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as info:
        cli.check_main(["--world-size", "4", "recipes/tiny_cpu.yaml", "train.memory_budget_gib=1e-4",
                        f"train.output_dir={out}"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tsp-check: error: auto settings: nothing fits the "
                                               "memory budget of 0.1 MiB per process")
    assert not out.exists()


def test_start_line_names_values_peak_and_budget():
    c = choose_memory_settings(_cfg(), world_size=2, budget=Budget(20 * GIB, "train.memory_budget_gib"),
                               cuda=False)
    assert c.line() == (f"auto: tsp_recompute=none, activation_checkpointing=false, head_buckets=1, "
                        f"checkpoint_replay_keeps=all, checkpoint_segment_blocks=1 "
                        f"(predicted peak {c.peak / GIB:.1f} GiB of 20.0 GiB budget: "
                        "train.memory_budget_gib)")
    applied = c.apply(_cfg())
    assert (applied.parallel.tsp_recompute, applied.train.activation_checkpointing,
            applied.parallel.head_buckets) == ("none", False, 1)


def test_auto_values_load_and_validate():
    """`auto` is each key's default and loads from YAML; other words are refused with the rule."""
    cfg = load_config(None, [])
    assert (cfg.parallel.tsp_recompute, cfg.train.activation_checkpointing, cfg.parallel.head_buckets,
            cfg.train.memory_budget_gib) == ("auto", "auto", "auto", None)
    validate_config(cfg)
    assert load_config(None, ["parallel.head_buckets=2"]).parallel.head_buckets == 2
    with pytest.raises(ValueError, match=r"'parallel.head_buckets'='many' must be an int or one of 'auto'"):
        load_config(None, ["parallel.head_buckets=many"])
    with pytest.raises(ValueError, match=r"train.activation_checkpointing='maybe' must be 'auto' or a bool"):
        validate_config(TrainConfig(train=TrainSection(activation_checkpointing="maybe")))
    with pytest.raises(ValueError, match=r"train.memory_budget_gib=0.0 must be > 0"):
        validate_config(load_config(None, ["train.memory_budget_gib=0.0"]))
    with pytest.raises(ValueError, match=r"parallel.head_buckets=0 must be an integer >= 1"):
        validate_config(load_config(None, ["parallel.head_buckets=0"]))


def test_tsp_plan_top_row_is_the_resolvers_choice(tmp_path):
    """tsp-plan ranks recompute modes, checkpointing and head buckets by default; the trainer's
    resolver, given the top row's scheme, D, ZeRO stage and batch split and the GPU's usable memory
    as its budget, chooses the same recompute mode, checkpointing and head buckets."""
    out = tmp_path / "plan.json"
    assert plan_cli.main(["--model", "7b", "--seq-len", "131072", "--global-batch", "8", "--gpu", "h100",
                          "--nodes", "1", "--schemes", "tsp", "--json", str(out)]) == 0
    top = json.loads(out.read_text())["ranked"][0]["layout"]
    assert top["tsp_recompute"] == "selective" and not top["activation_checkpointing"]
    cfg = load_config(None, ["model.size=7b", f"parallel.tsp_degree={top['degree']}",
                             f"zero.stage={top['zero_stage']}", "data.seq_len=131072",
                             f"data.micro_batch_size={top['micro_batch']}",
                             f"train.grad_accum={top['grad_accum']}", "train.dtype=bf16"])
    hw = get_profile("h100")
    budget = Budget(hw.hbm_bytes * Assumptions().hbm_usable, "h100")
    c = choose_memory_settings(cfg, world_size=8, budget=budget, cuda=True, hw=hw)
    assert (c.tsp_recompute, c.activation_checkpointing, c.head_buckets) == (
        top["tsp_recompute"], top["activation_checkpointing"], top["head_buckets"])


def test_gpu_budget_is_the_devices_memory_times_the_usable_share(monkeypatch):
    """On a GPU the budget is mem_get_info's total x Assumptions.hbm_usable (not the free memory,
    which differs between ranks), and the ranking takes the GPU's own profile by its name."""
    import torch

    from tsp_trainer.plan.auto import memory_budget, ranking_profile

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    budget = memory_budget(_cfg(), world_size=2, cuda=True)
    assert budget.bytes == 80 * GIB * 0.92 and budget.source == "GPU memory 80.0 GiB x 0.92 usable"
    assert ranking_profile(True).name == "h200" and ranking_profile(False).name == "h100"
    explicit = memory_budget(_cfg("train.memory_budget_gib=12.5"), world_size=2, cuda=True)
    assert (explicit.bytes, explicit.source) == (12.5 * GIB, "train.memory_budget_gib")


def test_checkpoint_replay_keeps_auto_takes_the_leanest_only_where_the_budget_needs_it():
    """Llama-3.1-8B at 2M tokens on D=8 (bf16, CUDA's route) under checkpointing: the replay
    keeping all is the fastest, attention and nothing need less memory and run slower. `auto`
    (the lean values are in the planner's search, layout.PLANNED_REPLAY_KEEPS, confirmed by the
    dry run) takes all where it fits, attention where only attention and nothing fit, nothing
    below that; an explicit value stays as written."""
    args = ["model.size=llama3_8b", "parallel.tsp_degree=8", "data.seq_len=2097152",
            "data.micro_batch_size=1", "train.grad_accum=1", "train.dtype=bf16",
            "train.activation_checkpointing=true", "parallel.tsp_recompute=full",
            "parallel.head_buckets=1", "train.checkpoint_segment_blocks=1", "train.attention_gqa=fused"]
    cfg = load_config(None, args)
    model, hw = cfg.model.to_model_config(), get_profile("h100")
    preds = {lay.replay_keeps: predict(model, lay, cfg.data.seq_len, hw, prec=BF16, device="cuda")
             for lay in memory_variants(model, run_layout(cfg, 8), recompute=("full",),
                                        checkpointing=(True,), buckets=(1,), replay=REPLAY_KEEPS)}
    peak = {k: p.memory["total"] for k, p in preds.items()}
    assert peak["nothing"] < peak["attention"] < peak["all"]                    # the premise
    assert preds["all"].step_time <= preds["attention"].step_time < preds["nothing"].step_time

    def chosen(budget: float, run: TrainConfig = cfg) -> str:
        choice = choose_memory_settings(run, world_size=8, budget=Budget(budget, "train.memory_budget_gib"),
                                        cuda=True, hw=hw)
        assert f"checkpoint_replay_keeps={choice.checkpoint_replay_keeps}, checkpoint_segment_blocks=1 " \
               "(predicted peak" in choice.line()
        return choice.checkpoint_replay_keeps

    assert chosen(peak["all"]) == "all"
    assert chosen((peak["attention"] + peak["all"]) / 2) == "attention"
    assert chosen((peak["nothing"] + peak["attention"]) / 2) == "nothing"
    with pytest.raises(AutoSettingsError):
        chosen(peak["nothing"] * 0.99)
    explicit = load_config(None, args + ["parallel.checkpoint_replay_keeps=attention"])
    assert chosen(peak["all"], explicit) == "attention"


@pytest.mark.parametrize("scheme", ["sp", "ulysses"])
def test_auto_plans_a_zero3_run_with_its_state_sharded_over_every_rank(scheme):
    """sp and ulysses run under ZeRO-3 (zero.stage auto): `auto` plans them with the state of the
    peers' model (plan/state.py zero3_state_bytes), each rank's weights, gradients and AdamW state
    1/W of the model's over the W = D x dp ranks, plus the layers' weights gathered for use; the
    choice's predicted peak is that layout's, below the ZeRO-2 plan of the same run (whole weights
    on every rank)."""
    from dataclasses import replace

    from tsp_trainer.plan.peers import head_chunk_saving
    from tsp_trainer.plan.state import param_count, zero3_gathered_bytes

    cfg = _cfg(f"parallel.scheme={scheme}", "train.memory_budget_gib=64", "parallel.tsp_recompute=full",
               "train.activation_checkpointing=auto")
    model, world = cfg.model.to_model_config(), 4
    lay = run_layout(cfg, world)
    assert (lay.scheme, lay.zero_stage, lay.world) == ("sp", 3, 4)
    choice = choose_auto_settings(cfg, world_size=world, cuda=False)
    chosen = replace(lay, activation_checkpointing=choice.activation_checkpointing)
    pred = predict(model, chosen, cfg.data.seq_len, get_profile("h100"), prec=FP32, device="cpu")
    n = param_count(model, chosen)
    assert pred.memory["params"] == -(-n * FP32.weight // world)            # 1/W of the weights
    assert pred.memory["grads"] == -(-n * 4 // world)
    assert pred.memory["optimizer"] == -(-n * FP32.optimizer // world)
    assert pred.memory["zero3_gathered"] == zero3_gathered_bytes(model, FP32)[1]
    chunks = choice.ulysses_head_chunks or 1
    saving = head_chunk_saving(model, chosen, cfg.data.seq_len, chunks, FP32)
    assert choice.peak == pred.memory["total"] - saving
    zero2 = predict(model, replace(chosen, zero_stage=2), cfg.data.seq_len, get_profile("h100"), prec=FP32,
                    device="cpu")
    assert pred.memory["total"] < zero2.memory["total"]

# 1B at 1M tokens on D=2 (bf16, CUDA's route, H100 rates), checkpointing with full recompute; the
# segment length and the activation offload auto (1B has 16 layers), the replay keeping all
OFFLOAD_ARGS = ["model.size=1b", "parallel.tsp_degree=2", "data.seq_len=1048576", "data.micro_batch_size=1",
                "train.grad_accum=1", "train.dtype=bf16", "train.activation_checkpointing=true",
                "parallel.tsp_recompute=full", "parallel.head_buckets=1", "train.checkpoint_segment_blocks=auto",
                "parallel.checkpoint_replay_keeps=all", "train.offload_prefetch=true",
                "train.offload_activations=auto"]


def _offload_predictions(cfg: TrainConfig) -> dict[tuple[bool, int], object]:
    """(offload, k) -> the planner's prediction of the run's checkpointed layout."""
    from dataclasses import replace
    model, hw = cfg.model.to_model_config(), get_profile("h100")
    return {(off, k): predict(model, replace(run_layout(cfg, 2), activation_checkpointing=True,
                                             offload_activations=off, checkpoint_segment_blocks=k),
                              cfg.data.seq_len, hw, prec=BF16)
            for off in (False, True) for k in (1, 2, 3, 4, 8)}


def _offload_choice(cfg: TrainConfig, device: float, host: float):
    return choose_memory_settings(cfg, world_size=2, budget=Budget(device, "device", host, "host"),
                                  cuda=True, hw=get_profile("h100"))


def test_offload_auto_only_when_the_device_budget_needs_it_then_the_fastest_the_host_holds():
    """train.offload_activations=auto: no offload whenever the run fits without it (the choice is
    the one offload=false makes); a device budget only offload or nesting meets, with the host
    ample: the offload at k = 1 (its copies hidden, nesting's extra forward not); the host short
    of every block input: the offload with fewer inputs pinned (k = 2) or nesting on the device,
    whichever the planner predicts faster among those the host holds."""
    cfg = load_config(None, OFFLOAD_ARGS)
    preds = _offload_predictions(cfg)
    peak = {key: p.memory["total"] for key, p in preds.items()}
    host = {key: p.memory["host_per_node"] for key, p in preds.items()}
    assert peak[(True, 1)] < peak[(False, 2)] < peak[(False, 1)]           # the premises
    assert host[(True, 2)] < host[(True, 1)] and preds[(True, 1)].step_time < preds[(False, 2)].step_time

    fits = _offload_choice(cfg, peak[(False, 1)], 1e6 * GIB)
    assert (fits.offload_activations, fits.checkpoint_segment_blocks) == (False, 1)
    plain = choose_memory_settings(load_config(None, OFFLOAD_ARGS[:-1]), world_size=2, cuda=True,
                                   budget=Budget(peak[(False, 1)], "device"), hw=get_profile("h100"))
    assert (plain.values() + ", offload_activations=false", plain.peak) == (fits.values(), fits.peak)
    assert fits.line().endswith("checkpoint_segment_blocks=1, offload_activations=false (predicted peak "
                                f"{fits.peak / GIB:.1f} GiB of {peak[(False, 1)] / GIB:.1f} GiB budget: device)")

    short = (peak[(False, 2)] + peak[(False, 1)]) / 2                        # HBM short of k = 1
    ample = _offload_choice(cfg, short, host[(True, 1)])
    assert (ample.offload_activations, ample.checkpoint_segment_blocks) == (True, 1)
    assert ample.line().endswith(f"; host {host[(True, 1)] / GIB:.1f} GiB per node of "
                                 f"{host[(True, 1)] / GIB:.1f} GiB: host)")
    assert ample.apply(cfg).train.offload_activations is True

    tight = _offload_choice(cfg, short, host[(True, 1)] * 0.99)              # host short of k = 1
    assert tight.checkpoint_segment_blocks > 1 and tight.peak <= short
    assert not tight.offload_activations or tight.host_bytes <= host[(True, 1)] * 0.99
    none = _offload_choice(cfg, short, host[(False, 1)])                     # host holds no offload
    assert none.checkpoint_segment_blocks > 1 and not none.offload_activations and none.peak <= short


def test_offload_auto_refusals_name_the_binding_memory():
    """Nothing fits the device: the smallest predicted peak; the offload fits the device but its
    pinned copies not the host: the least host bytes, against the host budget."""
    cfg = load_config(None, OFFLOAD_ARGS)
    preds = _offload_predictions(cfg)
    least = min(p.memory["total"] for p in preds.values())
    with pytest.raises(AutoSettingsError, match="nothing fits the memory budget of .* per process"):
        _offload_choice(cfg, least * 0.99, 1e6 * GIB)
    only_offload = preds[(True, 1)].memory["total"]
    assert only_offload == least                                             # the premise
    with pytest.raises(AutoSettingsError) as info:
        _offload_choice(cfg, only_offload, GIB)
    message = str(info.value)
    assert "\n" not in message and "nothing fits the host budget of 1.0 GiB per node (host)" in message
    # nesting under the offload regains its inner inputs on the host: every k has the same device
    # peak, and the refusal names the k pinning the least
    least_host = min(p.memory["host_per_node"] for (off, _), p in preds.items()
                     if off and p.memory["total"] <= only_offload)
    assert least_host < preds[(True, 1)].memory["host_per_node"]
    assert f"needs {least_host / GIB:.1f} GiB" in message


def test_offload_prefetch_auto_is_on_unless_only_fetching_on_demand_fits():
    """train.offload_prefetch=auto under the offload: prefetch wherever it fits (its copies are
    hidden; on demand they are exposed), on demand only when the budget needs that block's bytes;
    the start-up line names it, and a run without offload resolves it to true."""
    from dataclasses import replace

    from tsp_trainer.plan.resolve import resolve_run

    args = [a for a in OFFLOAD_ARGS if "offload" not in a and "segment" not in a]
    cfg = load_config(None, args + ["train.offload_activations=true", "train.checkpoint_segment_blocks=1"])
    model, hw, lay = cfg.model.to_model_config(), get_profile("h100"), run_layout(cfg, 2)
    on, off = (predict(model, replace(lay, activation_checkpointing=True, offload_prefetch=ahead),
                       cfg.data.seq_len, hw, prec=BF16) for ahead in (True, False))
    block_input = on.activation.terms["ac_block_input"]
    assert on.memory["total"] - off.memory["total"] == block_input            # one block input less
    assert off.times["offload_fetch_exposed_per_micro"] > 0 == on.times["offload_fetch_exposed_per_micro"]
    assert off.step_time > on.step_time
    ample = _offload_choice(cfg, on.memory["total"], None)
    assert ample.offload_prefetch is True and ample.line().endswith(
        f"offload_prefetch=true (predicted peak {on.memory['total'] / GIB:.1f} GiB of "
        f"{on.memory['total'] / GIB:.1f} GiB budget: device)")
    short = _offload_choice(cfg, on.memory["total"] - 1, None)
    assert short.offload_prefetch is False and short.peak == off.memory["total"]
    assert short.apply(cfg).train.offload_prefetch is False
    with pytest.raises(AutoSettingsError, match="offload_prefetch=false\); use more"):
        _offload_choice(cfg, off.memory["total"] - 1, None)
    plain = resolve_run(_cfg("train.memory_budget_gib=64"), world_size=4, cuda=False)
    assert plain.cfg.train.offload_prefetch is True


def test_offload_auto_loads_and_its_host_budget_on_cpu_is_what_the_device_budgets_leave(monkeypatch):
    from tsp_trainer.plan import auto

    monkeypatch.setattr(auto, "host_available_bytes", lambda: 10 * GIB + 123)
    cfg = _cfg("train.offload_activations=auto", "train.memory_budget_gib=2")
    budget = auto.memory_budget(cfg, world_size=4, cuda=False)
    assert (budget.bytes, budget.host) == (2 * GIB, 2 * GIB)
    assert budget.host_source == "host MemAvailable 10.0 GiB less 4 x 2.0 GiB device budgets"
    assert auto.memory_budget(_cfg("train.memory_budget_gib=2"), world_size=4, cuda=False).host is None
    with pytest.raises(ValueError, match=r"'train.offload_activations'='often' must be a bool \(true/false\) "
                                         "or one of 'auto'"):
        load_config(None, ["train.offload_activations=often"])
    validate_config(_cfg("train.offload_activations=auto", "parallel.tsp_recompute=selective",
                         "train.activation_checkpointing=false"))   # auto offload is left out for selective


def test_auto_plans_cpu_adam_on_the_host_under_zero_1_and_2_and_zero3_with_its_optimizer_on_the_device():
    """zero.offload_optimizer=cpu: a ZeRO-1 run is planned with AdamW's state on the host (none on
    the device); a ZeRO-3 run (sp) with its optimizer on the device, the planner's upper bound."""
    zero1 = run_layout(_cfg("zero.stage=1", "zero.offload_optimizer=cpu"), 4)
    assert zero1.offload_optimizer and zero1.zero_stage == 1
    pred = predict(_cfg().model.to_model_config(), zero1, 256, get_profile("h100"), prec=FP32, device="cpu")
    assert pred.memory["optimizer"] == 0
    zero3 = run_layout(_cfg("parallel.scheme=sp", "zero.offload_optimizer=cpu"), 4)
    assert (zero3.zero_stage, zero3.offload_optimizer) == (3, False)
    assert not run_layout(_cfg("zero.stage=1"), 4).offload_optimizer
