"""The console scripts and fresh interpreters, as subprocesses (each start imports torch anew, so
they live here rather than in tests/unit): tsp-dashboard and tsp-report, tsp-train refusing an
online run without a W&B login, the import boundary of tsp_trainer.config, and the CPU peak memory
reading of a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_input_checks import _no_login
from tests.unit.test_metrics_table import _write_run

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def test_tsp_dashboard_cli_writes_the_spec_and_fails_in_one_line_without_login(tmp_path):
    out = tmp_path / "view.json"
    proc = subprocess.run([str(BIN / "tsp-dashboard"), "--entity", "team", "--project", "tsp",
                           "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "6 sections" in proc.stdout and json.loads(out.read_text())["spec"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_API")}
    env.update(WANDB_CONFIG_DIR=str(tmp_path / "cfg"), HOME=str(tmp_path), WANDB_MODE="offline")
    save = subprocess.run([str(BIN / "tsp-dashboard"), "--entity", "team", "--project", "tsp"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert save.returncode == 1 and "tsp-dashboard: error: saving the view" in save.stderr
    assert save.stderr.strip().count("\n") == 0


def test_tsp_report_cli(tmp_path):
    run = tmp_path / "run"
    _write_run(run)
    proc = subprocess.run([str(BIN / "tsp-report"), str(run), "--out", str(tmp_path / "r.png")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "wrote" in proc.stdout and (tmp_path / "r.png").exists()
    bad = subprocess.run([str(BIN / "tsp-report"), str(tmp_path / "nope")], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "metrics.jsonl" in bad.stderr


def test_tsp_train_online_without_login_exits_2_and_writes_nothing(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "tsp_trainer", "train", "recipes/tiny_cpu.yaml",
                           "parallel.tsp_degree=1", "logging.wandb_mode=online",
                           f"train.output_dir={run}"],
                          cwd=REPO, env=_no_login(tmp_path) | {"PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("tsp-train: error")]
    assert len(errors) == 1 and "needs W&B credentials" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not run.exists()                      # no config.yaml, run.json or metrics.jsonl


def test_importing_config_does_not_import_omegaconf():
    # The model imports tsp_trainer.config; OmegaConf must stay behind load_config's call.
    code = ("import sys, tsp_trainer.config.load, tsp_trainer.config.validate; "
            "sys.exit('omegaconf' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


_RSS_PROBE = """
import torch
from tsp_trainer.observability import peak_memory_bytes
before = peak_memory_bytes("cpu")
x = torch.ones({n} // 4, dtype=torch.float32)      # written, so every page is resident
print(before, peak_memory_bytes("cpu"))
"""


def test_peak_memory_bytes_cpu_moves_by_a_written_tensor():
    """On CPU the peak is the process's max RSS in bytes: a fresh process (max RSS = RSS after
    import) that writes a 256 MiB tensor raises it by 256 MiB, to 3% (measured 1.005x). Linux
    keeps the max RSS across exec, so the probe is forked by a small shell, not by pytest (whose
    high-water mark it would start from)."""
    n = 256 * 2**20
    proc = subprocess.run(["sh", "-c", '"$0" -c "$1"; exit $?', sys.executable, _RSS_PROBE.format(n=n)],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    before, after = map(int, proc.stdout.split())
    assert before > 50 * 2**20                       # torch alone is resident: bytes, not KiB
    assert after - before == pytest.approx(n, rel=0.03)
