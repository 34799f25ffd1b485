"""A bad jsonl line far into one DP replica's file (beyond the start-up check's head and tail
samples), met by that replica's loader during training: every rank stops at the same step with
exit 2, and the job prints one line naming the file and the line (not the peers' CommErrors).

Four `tsp-train` processes (dp 2 x tsp 2) started as torchrun starts them (RANK, WORLD_SIZE,
MASTER_ADDR/PORT), without the launcher, whose own summary would hide each rank's exit code."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tsp_trainer.data.checks import SAMPLE_BYTES

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _corpus(folder: Path) -> tuple[Path, int, int]:
    """Two train files of ~3 x SAMPLE_BYTES each (one per DP replica); line `bad` of the second,
    in its middle third, is cut off. Returns (that file, the line, its byte offset)."""
    folder.mkdir()
    lines = [json.dumps({"text": f"document {i}: " + "some words of text " * 4}) + "\n"
             for i in range(3 * SAMPLE_BYTES // 100)]
    (folder / "train-00000-of-00002.jsonl").write_text("".join(lines))
    bad = len(lines) // 2 + 1
    broken = folder / "train-00001-of-00002.jsonl"
    broken.write_text("".join(lines[:bad - 1]) + '{"text": "cut off\n' + "".join(lines[bad - 1:]))
    offset = sum(len(line) for line in lines[:bad - 1])
    assert SAMPLE_BYTES < offset < broken.stat().st_size - SAMPLE_BYTES   # beyond both samples
    return broken, bad, offset


@pytest.mark.slow           # 4 rank processes started by hand (~13 s)
def test_bad_line_mid_training_stops_every_rank_with_one_line_and_exit_2(tmp_path):
    broken, bad, offset = _corpus(tmp_path / "corpus")
    world, port = 4, _free_port()
    args = [sys.executable, "-m", "tsp_trainer", "train", "recipes/tiny_cpu.yaml",
            f"data.source={tmp_path / 'corpus'}", "train.steps=6", "train.eval_every=0",
            "data.eval_split=null", "checkpoint.every=0", "logging.progress_bar=false",
            f"train.output_dir={tmp_path / 'run'}", "train.collective_timeout_s=60"]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "RANK", "WORLD"))}
    procs = [subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True,
                              env=base | {"PYTHONPATH": str(REPO), "RANK": str(r), "LOCAL_RANK": str(r),
                                          "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
                                          "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                          "OMP_NUM_THREADS": "1"})
             for r in range(world)]
    outputs = [p.communicate(timeout=500) for p in procs]
    stderr = "".join(err for _, err in outputs)
    assert [p.returncode for p in procs] == [2] * world, stderr
    errors = [line for line in stderr.splitlines() if "error" in line.lower()]
    assert errors == [f"tsp-train: error (rank 0): data file {broken} line {bad} (byte offset "
                      f"{offset}): not valid JSON (Unterminated string starting at, column 10); "
                      "expected one JSON object per line (jsonl)"], stderr
    assert "Traceback" not in stderr and "CommError" not in stderr
