"""tsp-plan --max-seq-len (plan/longest.py): the longest sequence a scheme fits is a boundary of
the memory model (it fits, one granule more does not), activation offload lengthens it and keeps
the GPU-resident layers to a window, and the CLI prints both tables and writes JSON."""

from __future__ import annotations

import json

import pytest

from tsp_trainer.config.model import model_config
from tsp_trainer.plan import cli
from tsp_trainer.plan.activations import activation_memory
from tsp_trainer.plan.layout import Layout
from tsp_trainer.plan.precision import BF16
from tsp_trainer.plan.predict import Assumptions, predict
from tsp_trainer.plan.hardware import get_profile
from tsp_trainer.plan.longest import _fitting, longest_seq_len

H100 = get_profile("h100")
CFG = model_config("llama3_8b")


def _fits(scheme, seq_len, offload=False):
    return _fitting(CFG, scheme, seq_len, hw=H100, world=8, global_batch=1, prec=BF16,
                    assumptions=Assumptions(), max_degree=64, offload=offload)


@pytest.mark.parametrize("scheme,offload", [("tsp", False), ("tsp", True), ("tp", False)])
def test_longest_is_the_boundary_of_the_memory_model(scheme, offload):
    r = longest_seq_len(CFG, scheme, hw=H100, nodes=1, offload=offload)
    assert r.seq_len > 0 and r.seq_len % 1024 == 0
    assert _fits(scheme, r.seq_len, offload) is not None
    assert _fits(scheme, r.seq_len + 1024, offload) is None
    assert r.best.memory["total"] <= r.best.capacity
    assert r.best.layout.offload_activations is offload


def test_tsp_reaches_further_than_tp_and_offload_further_still():
    tsp = longest_seq_len(CFG, "tsp", hw=H100, nodes=1).seq_len
    tp = longest_seq_len(CFG, "tp", hw=H100, nodes=1).seq_len
    tsp_off = longest_seq_len(CFG, "tsp", hw=H100, nodes=1, offload=True).seq_len
    tsp_h200 = longest_seq_len(CFG, "tsp", hw=get_profile("h200"), nodes=1).seq_len
    assert tp < tsp < tsp_off and tsp < tsp_h200


def test_optimizer_offload_lengthens_the_longest_sequence():
    """With AdamW's state on the host every layout has 12 B / param more HBM for activations, so
    the longest sequence grows; its best layout offloads and reports the host bytes."""
    base = longest_seq_len(CFG, "tsp", hw=H100, nodes=1)
    off = longest_seq_len(CFG, "tsp", hw=H100, nodes=1, offload_optimizer=True)
    assert off.seq_len > base.seq_len
    assert off.best.layout.offload_optimizer and off.best.layout.zero_stage >= 1
    assert off.best.memory["optimizer"] == 0 and off.best.memory["host_optimizer"] > 0
    assert not base.best.layout.offload_optimizer


def test_offload_keeps_two_layers_on_the_gpu_and_the_rest_on_the_host():
    s = 131072
    lay = dict(scheme="tsp", degree=8, activation_checkpointing=True)
    base = activation_memory(CFG, Layout(**lay), s, BF16)
    off = activation_memory(CFG, Layout(**lay, offload_activations=True), s, BF16)
    L = CFG.num_layers
    assert off.host == L * base.stored_per_layer and base.host == 0
    assert off.stored == base.stored - (L - 1) * base.stored_per_layer
    assert off.phases["backward"] == base.phases["backward"] - (L - 2) * base.stored_per_layer
    p = predict(CFG, Layout(**lay, offload_activations=True), s, H100)
    assert p.memory["host_offloaded"] == off.host and p.times["offload_per_micro"] > 0
    assert "offload" in p.layout.label()


def test_selective_recompute_longest_is_a_boundary_and_refuses_offload():
    """With --tsp-recompute selective the TSP answer is a boundary of the model among selective
    layouts (no AC), shorter than full recompute's; with offload it is refused, saying why."""
    r = longest_seq_len(CFG, "tsp", hw=H100, nodes=1, tsp_recompute="selective")
    fits = [_fitting(CFG, "tsp", s, hw=H100, world=8, global_batch=1, prec=BF16, assumptions=Assumptions(),
                     max_degree=64, offload=False, tsp_recompute="selective") for s in (r.seq_len, r.seq_len + 1024)]
    assert r.seq_len > 0 and fits[0] is not None and fits[1] is None
    assert r.best.layout.selective and not r.best.layout.activation_checkpointing
    assert r.seq_len < longest_seq_len(CFG, "tsp", hw=H100, nodes=1).seq_len
    off = longest_seq_len(CFG, "tsp", hw=H100, nodes=1, offload=True, tsp_recompute="selective")
    assert off.best is None and "refused with activation offload" in off.as_dict()["refused"]


def test_recompute_none_longest_is_a_boundary_shorter_than_selective_and_refuses_offload():
    """--tsp-recompute none: a boundary among none layouts (no AC), shorter than selective's
    (it keeps the MLP's gate/up too); with offload refused, naming none."""
    r = longest_seq_len(CFG, "tsp", hw=H100, nodes=1, tsp_recompute="none")
    fits = [_fitting(CFG, "tsp", s, hw=H100, world=8, global_batch=1, prec=BF16, assumptions=Assumptions(),
                     max_degree=64, offload=False, tsp_recompute="none") for s in (r.seq_len, r.seq_len + 1024)]
    assert r.seq_len > 0 and fits[0] is not None and fits[1] is None
    assert r.best.layout.keeps_mlp and not r.best.layout.activation_checkpointing
    assert r.seq_len < longest_seq_len(CFG, "tsp", hw=H100, nodes=1, tsp_recompute="selective").seq_len
    off = longest_seq_len(CFG, "tsp", hw=H100, nodes=1, offload=True, tsp_recompute="none")
    assert off.best is None and "tsp_recompute=none is refused with activation offload" in off.as_dict()["refused"]


def test_cli_max_seq_len_tables_and_json(tmp_path, capsys):
    out = tmp_path / "longest.json"
    assert cli.main(["--model", "llama3_8b", "--gpu", "h100", "--nodes", "1", "--schemes", "tsp,tp",
                     "--max-seq-len", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "activations in GPU memory" in text and "with activation offload to host" in text
    doc = json.loads(out.read_text())
    assert [r["scheme"] for r in doc["results"]["gpu"]] == ["tsp", "tp"]
    assert doc["results"]["offload"][0]["max_seq_len"] > doc["results"]["gpu"][0]["max_seq_len"]
    # each answer names its limit and its peak's pieces; TSP's offload answer is bound by the
    # host: its replay keeps nothing (the planner searches every checkpoint_replay_keeps) and its
    # tiled layers keep no norm output, so a block's backward fits HBM below the length whose 32
    # offloaded block inputs fill the node's 2 TB
    assert [r["bound_by"] for r in doc["results"]["gpu"]] == ["HBM", "HBM"]
    off = doc["results"]["offload"][0]
    assert off["bound_by"] == "host" and off["memory"]["total"] < 0.92 * 80e9
    assert "keep=nothing" in off["layout"]
    assert off["memory"]["host_per_node"] <= 2e12
    assert "tsp: peak 73.6 GB = parameters 2.0 + gradients 6.0 + optimizer 12.0" in text
    b = doc["results"]["gpu"][0]["peak_breakdown"]
    # the in-HBM answer: a block's backward is the peak
    assert b["total"] == doc["results"]["gpu"][0]["memory"]["total"] and b["peak_phase"] == "backward"


def test_cli_max_seq_len_and_dry_run_are_separate_modes(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--max-seq-len", "--dry-run"])
    assert info.value.code == 2
    assert "--max-seq-len and --dry-run are two modes" in capsys.readouterr().err


def test_the_search_stops_at_the_trainers_longest_sequence():
    """RoPE's fp32 angles take exact positions below 2^24 only (the trainer refuses longer
    sequences), so TSP's answer stops at 16,777,216 tokens, bound by the RoPE positions, however
    much memory is left; below a limit the search still finds the longest fitting granule."""
    from types import SimpleNamespace

    from tsp_trainer.config.model import FP32_EXACT_POSITIONS
    from tsp_trainer.plan.longest import TRAINER_LIMIT, search_longest

    def fitting_up_to(tokens):
        def predictions(seq_len):
            return [SimpleNamespace(fits=seq_len <= tokens, memory={"total": seq_len, "host_per_node": 0},
                                    layout=SimpleNamespace(checkpoint_segment_blocks=1), exceeds=("HBM",))]
        return predictions

    assert TRAINER_LIMIT == FP32_EXACT_POSITIONS == 16_777_216
    seq, best, bound = search_longest(fitting_up_to(1 << 30), 1024, limit=TRAINER_LIMIT, limit_name="RoPE positions")
    assert (seq, bound, best.memory["total"]) == (16_777_216, "RoPE positions", 16_777_216)
    assert search_longest(fitting_up_to(1 << 30), 3072, limit=TRAINER_LIMIT)[0] == 16_777_216 // 3072 * 3072
    assert search_longest(fitting_up_to(5_000_000), 1024, limit=TRAINER_LIMIT)[:1] == (4_999_168,)
    assert search_longest(fitting_up_to(5_000_000), 1024, limit=TRAINER_LIMIT)[2] == "HBM"
