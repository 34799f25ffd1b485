"""Helpers shared by the data tests: small corpora written to tmp, batch comparison, and the bytes
a process reads (Linux /proc/self/io rchar: every byte returned by a read syscall)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "data" / "corpus"
TOKENIZER = REPO / "data" / "tokenizer"
RECIPE = REPO / "recipes" / "tiny_cpu.yaml"


def write_jsonl(path: Path, texts, field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: t}) + "\n" for t in texts))
    return path


def take(loader, n):
    return [next(loader) for _ in range(n)]


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x["input_ids"], y["input_ids"]), f"batch {i}"
        assert torch.equal(x["labels"], y["labels"]), f"batch {i}"


def bytes_read() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no rchar line")


def tiny_config(overrides=()):
    from tsp_trainer.config import load_config

    base = [f"data.source={CORPUS}", f"data.tokenizer={TOKENIZER}", "data.seq_len=64",
            "data.micro_batch_size=2", "train.eval_every=0", "logging.progress_bar=false"]
    return load_config(str(RECIPE), base + list(overrides))
