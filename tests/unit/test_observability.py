"""observability: FLOP formula against hand-computed numbers, MFU arithmetic, sinks, rank-aware
logging, the W&B offline smoke test, and the progress bar on a non-TTY stream."""

import ast
import io
import json
import logging
import pathlib

import pytest

from tsp_trainer.config import ModelConfig, model_config
from tsp_trainer.observability import (
    DEVICE_PEAK_FLOPS,
    ConsoleSink,
    JsonlSink,
    MetricsSink,
    MultiSink,
    NullSink,
    ProgressBar,
    StepMetrics,
    attention_flops_per_token,
    flops_per_token,
    format_console_line,
    get_logger,
    make_sinks,
    matmul_params,
    peak_flops_for,
)


# vocab 1024, h 64, 2 layers, 4 heads (head_dim 16), 2 kv heads (kv width 32), intermediate 128.
TINY = ModelConfig(vocab_size=1024, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   intermediate_size=128)


# ---- FLOP formula ---------------------------------------------------------------------------

def test_tiny_flops_hand_computed():
    # per layer: Wq 64*64 + Wk 64*32 + Wv 64*32 + Wo 64*64 + gate/up/down 3*64*128 = 36864
    # 2 layers = 73728; LM head 1024*64 = 65536; N_matmul = 139264
    assert matmul_params(TINY) == 139264
    s = 128
    # attention fwd per token, all layers: 2 layers * 2 * 2 * 128 * 64 = 65536 full, 32768 causal
    assert attention_flops_per_token(TINY, s, causal_half=False) == 65536
    assert attention_flops_per_token(TINY, s) == 32768
    # forward: 2 * 139264 + 32768 = 311296; training = 3x
    assert flops_per_token(TINY, s, training=False) == 311296
    assert flops_per_token(TINY, s) == 3 * 311296 == 933888
    # full square: 3 * (278528 + 65536)
    assert flops_per_token(TINY, s, causal_half=False) == 1032192
    assert flops_per_token(TINY, s, causal_full=True) == 1032192


def test_causal_half_vs_full_differs_by_half_the_attention_term():
    for s in (256, 4096):
        full = flops_per_token(TINY, s, causal_half=False)
        half = flops_per_token(TINY, s)
        # training attention term: 3 * L * 4 * S * h full; the causal count saves half of it
        assert full - half == 3 * TINY.num_layers * 4 * s * TINY.hidden_size / 2


def test_llama2_7b_at_4096():
    cfg = model_config("7b")
    s = 4096
    # 32 * (4*4096^2 + 3*4096*11008) + 32000*4096 = 6,607,077,376 matmul params (~6.7e9 with embeddings)
    assert matmul_params(cfg) == 6_607_077_376
    attention = 6 * cfg.num_layers * s * cfg.hidden_size        # 3 x (L * 4 * S * h / 2) = 3.22e9
    assert flops_per_token(cfg, s) == 6 * 6_607_077_376 + attention
    assert flops_per_token(cfg, s) == pytest.approx(6 * 6.7e9 + attention, rel=0.02)
    # Megatron's attention term per token, 72*L*h^2 * s/(6h) = 12*L*s*h, is the full square
    assert flops_per_token(cfg, s, causal_half=False) - 6 * matmul_params(cfg) == 12 * 32 * s * 4096


def test_bad_seq_len():
    with pytest.raises(ValueError, match="seq_len"):
        flops_per_token(TINY, 0)


# ---- step metrics ---------------------------------------------------------------------------

def test_step_metrics_mfu_math():
    fpt = flops_per_token(model_config("7b"), 4096)
    m = StepMetrics.compute(tokens=2**20, step_time_s=2.0, world_size=8, model_flops_per_token=fpt,
                            hardware_flops_per_token=1.25 * fpt, peak_flops_per_device=989e12)
    assert m.tokens_per_s == 2**19
    assert m.tokens_per_s_per_device == 2**16
    assert m.tflops_per_device == pytest.approx(2**16 * fpt / 1e12)
    assert m.mfu == pytest.approx(2**16 * fpt / 989e12)          # ~0.284
    assert m.hfu == pytest.approx(1.25 * m.mfu)
    assert set(m.as_dict()) == {"tokens", "step_time_s", "tokens_per_s", "tokens_per_s_per_device",
                                "tflops_per_device", "mfu", "hfu"}


def test_step_metrics_without_peak_reports_none():
    m = StepMetrics.compute(tokens=1000, step_time_s=0.5, world_size=2, model_flops_per_token=1e6,
                            peak_flops_per_device=DEVICE_PEAK_FLOPS["cpu"])
    assert m.tokens_per_s == 2000 and m.tokens_per_s_per_device == 1000
    assert m.mfu is None and m.hfu is None
    with pytest.raises(ValueError, match="step_time_s"):
        StepMetrics.compute(tokens=1, step_time_s=0.0, world_size=1, model_flops_per_token=1.0)


def test_peak_flops_table():
    assert peak_flops_for("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_for("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_for("NVIDIA H200") == 989e12
    assert peak_flops_for("AMD Instinct MI300X") == 1307e12
    assert peak_flops_for("cpu") is None and peak_flops_for("Some GPU") is None


# ---- sinks ----------------------------------------------------------------------------------

def test_jsonl_sink_writes_parseable_lines(tmp_path):
    import torch

    path = tmp_path / "sub" / "metrics.jsonl"
    sink = JsonlSink(path)
    sink.log(1, {"loss": 2.5, "lr": 1e-3, "mfu": None})
    assert json.loads(path.read_text().splitlines()[0])["loss"] == 2.5     # flushed before close
    sink.log(2, {"loss": torch.tensor(1.5), "grad_norm": float("nan")})
    sink.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [{"step": 1, "loss": 2.5, "lr": 1e-3, "mfu": None},
                     {"step": 2, "loss": 1.5, "grad_norm": None}]
    with pytest.raises(RuntimeError, match="after close"):
        sink.log(3, {})


def test_make_sinks_null_off_rank0(tmp_path):
    for rank in (1, 7):
        sink = make_sinks(global_rank=rank, wandb_mode="offline", project="p", run_name="r", config={},
                          output_dir=tmp_path)
        assert isinstance(sink, NullSink)
    assert not any(tmp_path.iterdir())
    with pytest.raises(ValueError, match="wandb_mode"):
        make_sinks(global_rank=0, wandb_mode="on", project="p", run_name="r", config={}, output_dir=tmp_path)


def test_make_sinks_rank0_disabled_wandb(tmp_path):
    sink = make_sinks(global_rank=0, wandb_mode="disabled", project="p", run_name="r", config={},
                      output_dir=tmp_path)
    assert isinstance(sink, MultiSink) and isinstance(sink, MetricsSink)
    assert [type(s) for s in sink.sinks] == [JsonlSink, ConsoleSink]
    sink.log(3, {"loss": 1.0})
    sink.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 3, "loss": 1.0}
    assert not (tmp_path / "wandb").exists()


def test_console_line():
    line = format_console_line(12, {"train/loss": 3.45678, "train/lr": 3e-4, "train/grad_norm": 1.2345,
                                    "perf/tokens_per_s": 12345.0, "perf/mfu": 0.412,
                                    "mem/peak_gib": 12.3, "mystery": 1})
    assert line == "step 12 | loss 3.4568 | lr 3.00e-04 | gnorm 1.234 | 12.35k tok/s | MFU 41.2% | mem 12.3 GiB"
    assert format_console_line(1, {"train/loss": 2.0, "perf/mfu": None}) == "step 1 | loss 2.0000"


def test_wandb_offline_run(tmp_path, monkeypatch):
    for key, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path),
                       "WANDB_CACHE_DIR": str(tmp_path / "cache"), "WANDB_SILENT": "true"}.items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "run"
    sink = make_sinks(global_rank=0, wandb_mode="offline", project="tsp-test", run_name="smoke",
                      config={"model": {"hidden_size": 64}}, output_dir=out, console=False)
    for step in range(1, 4):
        sink.log(step, {"loss": 1.0 / step, "mfu": None, "tokens_per_s": 100.0})
    sink.close()
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("run-*.wandb"))
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3


def test_only_wandb_sink_imports_wandb():
    package = pathlib.Path(__file__).resolve().parents[2] / "tsp_trainer"
    offenders = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.split(".")[0] == "wandb" for n in names) and path.name != "wandb_sink.py":
                offenders.append(str(path))
    assert offenders == []


# ---- logging --------------------------------------------------------------------------------

def test_rank_logger(caplog):
    caplog.set_level(logging.INFO, logger="tsp_trainer.test_obs")
    get_logger("tsp_trainer.test_obs", rank=0).info("hello %d", 1)
    get_logger("tsp_trainer.test_obs", rank=3).info("dropped")
    get_logger("tsp_trainer.test_obs", rank=3).warning("kept")
    get_logger("tsp_trainer.test_obs", rank=2, only_rank0=False).info("all ranks")
    assert [r.getMessage() for r in caplog.records] == ["[rank 0] hello 1", "[rank 3] kept",
                                                        "[rank 2] all ranks"]
    assert [r.rank for r in caplog.records] == [0, 3, 2]


# ---- progress bar ---------------------------------------------------------------------------

def test_progress_bar_non_tty_is_silent():
    stream = io.StringIO()
    with ProgressBar(total=5, stream=stream) as bar:
        assert not bar.enabled
        for _ in range(5):
            bar.update(loss=1.0, tokens_per_s=1000.0)
    assert stream.getvalue() == ""


def test_progress_bar_forced_on_non_tty_shows_postfix():
    stream = io.StringIO()
    with ProgressBar(total=4, initial=1, stream=stream, enabled=True) as bar:
        for _ in range(3):
            bar.update(loss=2.34567, tokens_per_s=12345.0)
    text = stream.getvalue()
    assert "4/4" in text and "loss 2.3457" in text and "12.35k tok/s" in text
    quiet = io.StringIO()
    ProgressBar(total=4, stream=quiet, enabled=True, rank=1).update(loss=1.0)
    assert quiet.getvalue() == ""


def test_null_sink_takes_every_sink_call_and_writes_nothing(tmp_path, monkeypatch, capsys, caplog):
    """Ranks != 0 get a NullSink where rank 0 gets a MultiSink: it must answer every call the
    trainer makes on rank 0's sink (also after close, unlike JsonlSink), and leave no trace."""
    import torch

    rank0_calls = {name for name in dir(MultiSink) if not name.startswith("_")}   # log, mark_preempting, close
    assert rank0_calls <= set(dir(NullSink))
    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.DEBUG)
    sink = NullSink()
    assert sink.log(1, {"loss": torch.tensor(2.0), "mfu": None}) is None
    sink.mark_preempting()
    sink.close()
    sink.log(2, {"loss": 1.0})
    assert list(tmp_path.iterdir()) == []
    assert capsys.readouterr() == ("", "")
    assert caplog.records == []


def test_dashboard_json_needs_no_entity_or_project(tmp_path, capsys):
    """--json PATH writes the view offline: --entity / --project are optional there (the spec then
    names none); saving to W&B without them is refused by argparse, naming both."""
    from tsp_trainer.observability.dashboard import main as dashboard_main

    out = tmp_path / "view.json"
    assert dashboard_main(["--json", str(out)]) == 0
    spec = json.loads(out.read_text())
    assert "entity" not in spec and "project" not in spec
    assert [s["name"] for s in spec["spec"]["section"]["panelBankConfig"]["sections"]][:3] == [
        "train", "eval", "perf"]
    with pytest.raises(SystemExit) as exc:
        dashboard_main(["--entity", "team"])
    assert exc.value.code == 2
    assert "--project needed to save the view to W&B (or write it offline with --json PATH)" in \
        capsys.readouterr().err
