"""tsp-bench pieces that need no process group: argument validation (one clear error before
anything is launched), the memory tracker against torch's MemTracker, the HF name mapping."""

from __future__ import annotations

import pytest
import torch

from tsp_trainer.bench import cli
from tsp_trainer.bench.run import build_hf_llama, to_hf_state_dict
from tsp_trainer.config import ModelConfig
from tsp_trainer.model import Transformer
from tsp_trainer.tools.memory import LiveTensorMemory, state_bytes

# Degrees above the core count only warn (step times oversubscribed); not what these tests check.
pytestmark = pytest.mark.filterwarnings("ignore:.*oversubscribed")


def _spec(argv: str):
    return cli.spec_from_args(cli.build_parser().parse_args(argv.split()))


@pytest.mark.parametrize("argv,match", [
    ("--schemes tsp,ring", r"unknown scheme 'ring'"),
    ("--schemes ,", r"--schemes is empty"),
    ("--model huge", r"--model=.huge. is neither a named size"),
    ("--degree 0", r"--degree=0 must be >= 1"),
    ("--steps -1", r"--steps=-1 must be >= 0"),
    ("--warmup 0", r"--warmup=0 must be >= 1"),
    ("--degree 3 --schemes tp", r"scheme tp with --degree=3: parallel.tsp_degree=3 and model.num_kv_heads=2 "
                                r"divide neither way"),
    ("--degree 4 --hidden 96 --heads 12 --kv-heads 6 --schemes tsp",
     r"parallel.tsp_degree=4 and model.num_kv_heads=6 divide neither way"),
    ("--degree 2 --seq-len 30 --schemes sp", r"data.seq_len=30 is not divisible by 2 x"),
    ("--degree 4 --schemes tp_x_sp --tp-degree 3", r"--tp-degree x --sp-degree = 3 x None is not --degree=4"),
    ("--degree 4 --schemes tp_x_sp --tp-degree 2 --sp-degree 4", r"2 x 4 is not --degree=4"),
    ("--degree 4 --schemes tsp --tp-degree 2", r"options of scheme tp_x_sp"),
    ("--degree 2 --schemes tsp --head-buckets 2", r"parallel.head_buckets=2"),
    ("--hidden 100 --heads 3", r"model.hidden_size=100 must be divisible by model.num_heads=3"),
    ("--backend nccl", r"GPUs with --backend=nccl" if not torch.cuda.is_available() else r"^$"),
    ("--degree 1 --schemes tsp --reference alst", r"--reference=alst with --degree=1: .* --degree >= 2"),
    ("--degree 2 --seq-len 33 --schemes tp --reference alst", r"--reference=alst with --degree=2: data.seq_len=33"),
    ("--tsp-recompute none --activation-checkpointing",
     r"--tsp-recompute=none with --activation-checkpointing: .* drop one of them"),
    ("--tsp-recompute selective --activation-checkpointing", r"--tsp-recompute=selective with"),
])
def test_bad_arguments_raise_one_clear_error(argv, match):
    if match == r"^$":
        pytest.skip("needs a machine without CUDA")
    with pytest.raises(ValueError, match=match):
        _spec(argv)


def test_main_reports_error_and_exit_code(capsys, monkeypatch):
    launched = []
    monkeypatch.setattr(cli, "run", lambda *a, **k: launched.append(a))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--schemes", "tsp,nope"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "tsp-bench: error:" in err and "'nope'" in err
    assert not launched


@pytest.mark.parametrize("mode", ["full", "selective", "none"])
def test_tsp_recompute_reaches_tsp_only(mode):
    """--tsp-recompute goes to parallelize() for tsp (every value of parallel.tsp_recompute) and
    not to the baselines, which refuse options they do not know."""
    spec = _spec(f"--degree 2 --schemes tsp,tp --tsp-recompute {mode}")
    assert spec.options("tsp")["tsp_recompute"] == mode and "tsp_recompute" not in spec.options("tp")
    with pytest.raises(SystemExit):
        _spec("--tsp-recompute partial")


def test_sp_and_ulysses_run_under_zero3_unless_replicated_weights():
    """The trainer's zero.stage auto: ZeRO-3 for sp and ulysses, 0 (a plain AdamW) for the schemes
    that shard their weights over the axis; --replicated-weights keeps sp and ulysses whole."""
    schemes = "--degree 2 --schemes tsp,tp,tp_sp,sp,ulysses"
    assert {s: _spec(schemes).zero_stage(s) for s in ("tsp", "tp", "tp_sp", "sp", "ulysses")} == \
        {"tsp": 0, "tp": 0, "tp_sp": 0, "sp": 3, "ulysses": 3}
    replicated = _spec(schemes + " --replicated-weights")
    assert [replicated.zero_stage(s) for s in ("sp", "ulysses")] == [0, 0]


def test_defaults_resolve_tp_x_sp_layout():
    spec = _spec("--degree 2 --kv-heads 4 --seq-len 64")
    assert (spec.tp_degree, spec.sp_degree) == (1, 2)
    spec = _spec("--degree 4 --kv-heads 4 --seq-len 64 --threads 1")
    assert (spec.tp_degree, spec.sp_degree) == (2, 2)
    assert spec.schemes == ("tsp", "tp", "tp_sp", "sp", "tp_x_sp", "ulysses")
    assert spec.options("tp_x_sp") == {"tp_degree": 2, "sp_degree": 2, "tp_sequence_parallel": False}
    assert _spec("--degree 4 --kv-heads 4 --seq-len 64 --sp-degree 4 --threads 1").tp_degree == 1


def _tiny():
    cfg = ModelConfig(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      intermediate_size=128)
    model = Transformer(cfg)
    model.init_weights(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 128), generator=torch.Generator().manual_seed(0))
    return cfg, model, ids, ids.roll(-1, dims=1)


def test_tracker_counts_allocations_and_frees():
    tracker = LiveTensorMemory()
    keep = torch.zeros(1)
    tracker.ignore(keep)
    with tracker:
        a = torch.ones(1000)            # 4000 B
        b = a * 2                       # 8000 B live
        del a
        c = torch.ones(250)             # 5000 B live
        keep.add_(1)                    # in place on an ignored storage: not counted
    assert (tracker.peak, tracker.live) == (8000, 5000)
    del b, c
    assert tracker.live == 0


def test_tracker_matches_torch_memtracker_on_a_training_step():
    from torch.distributed._tools.mem_tracker import MemTracker

    _, model, ids, labels = _tiny()
    params = list(model.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)

    def step():
        total, count = model.loss_sum(ids, labels)
        (total / count).backward()

    ours = LiveTensorMemory()
    ours.ignore(*params, *(p.grad for p in params), ids, labels)
    with ours:
        step()
    ref = MemTracker()
    ref.track_external(model, ids, labels)
    with ref:
        step()
    peak = next(iter(ref.get_tracker_snapshot("peak").values()))["Total"]
    outside = 2 * sum(p.numel() * p.element_size() for p in params) + 2 * ids.numel() * ids.element_size()
    assert ours.peak == peak - outside
    opt = torch.optim.AdamW(params)
    opt.step()
    sizes = state_bytes(model, opt)
    assert sizes["param_bytes"] == sizes["grad_bytes"] == outside // 2 - ids.numel() * ids.element_size()
    assert sizes["optim_bytes"] >= 2 * sizes["param_bytes"]


@pytest.mark.parametrize("family", ["llama", "qwen2", "llama_biases_yarn"])
def test_hf_llama_with_our_weights_gives_our_logits(family):
    """The comparison model of tsp-bench is transformers' class of the model's family."""
    from tests.distributed.tsp_cases import init_model
    from tsp_trainer.config.model import RopeScaling

    cfg, model, ids, _ = _tiny()
    changes = {"llama": {}, "qwen2": {"family": "qwen2", "qkv_bias": True},
               "llama_biases_yarn": {"qkv_bias": True, "o_bias": True, "mlp_bias": True,
                                     "rope_scaling": RopeScaling("yarn", factor=4.0,
                                                                 original_max_position_embeddings=8)}}
    if changes[family]:
        cfg = cfg.replace(**changes[family])
        model = Transformer(cfg)
        init_model(model, 0)
    hf = build_hf_llama(cfg, ids.shape[1], to_hf_state_dict(model.state_dict()))
    assert type(hf).__name__ == ("Qwen2" if family == "qwen2" else "Llama") + "ForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("timed,panels", [(False, 2), (True, 3)])
def test_replot_draws_a_throughput_panel_only_for_timed_runs(tmp_path, timed, panels):
    """The saved JSON redraws its PNG; a memory-only run (--steps 0) has no throughput panel, a run
    with timed steps (tokens_per_s in its rows) has one."""
    import json
    import pathlib

    import matplotlib.image

    from tsp_trainer.bench.report import replot

    saved = pathlib.Path(__file__).resolve().parents[2] / "docs" / "results" / "tsp_bench" / "d4_s1024_mem.json"
    result = json.loads(saved.read_text())
    if timed:                       # the same run as if its steps had been timed
        for i, row in enumerate(result["schemes"]):
            row["tokens_per_s"] = 1000.0 + i
    (tmp_path / "run.json").write_text(json.dumps(result))
    out = tmp_path / "replot.png"
    replot(str(tmp_path / "run.json"), str(out))
    height, width = matplotlib.image.imread(out).shape[:2]
    # 5 in of width per panel at 110 dpi (legends below the axes add height, not width)
    assert round(width / (5 * 110)) == panels, (width, height)


def test_tsp_recompute_auto_is_the_trainers_rule_and_explicit_values_win(monkeypatch, capsys):
    """--tsp-recompute auto (the default) takes the trainer's rule: with memory to spare the mode
    that computes least (none), with a budget that only full fits, full; explicit values stay."""
    from tsp_trainer.plan import auto

    argv = "--model tiny --seq-len 256 --degree 2 --schemes tsp,tp"
    assert _spec(argv).tsp_recompute == "none"
    assert "tsp-bench: auto: tsp_recompute=none" in capsys.readouterr().out
    assert _spec(argv + " --tsp-recompute selective").tsp_recompute == "selective"
    assert _spec(argv + " --activation-checkpointing").tsp_recompute == "full"   # the only one with AC
    model = _spec(argv + " --tsp-recompute full").model
    peaks = {}
    for mode in ("full", "none"):
        lay = auto.Layout("tsp", 2, dp=1, zero_stage=0, micro_batch=1, grad_accum=1, tsp_recompute=mode)
        peaks[mode] = auto.predict(model, lay, 256, auto.ranking_profile(False), prec=auto.PRECISIONS["fp32"],
                                   device="cpu").memory["total"]
    tight = auto.Budget((peaks["full"] + peaks["none"]) / 2, "test")      # full fits, none does not
    monkeypatch.setattr(auto, "device_budget", lambda **kw: tight)
    assert _spec(argv).tsp_recompute in ("full", "selective") and peaks["full"] < tight.bytes < peaks["none"]
