"""No secret lands in a run folder: a tiny tsp-train job (one process, W&B offline, a checkpoint)
runs with WANDB_API_KEY, HF_TOKEN and a ~/.netrc entry for W&B set to sentinel values, and no file
under its output folder (config.yaml, run.json, metrics.jsonl, the lease, checkpoints, W&B's
offline run files and logs) holds any of them, as text or base64."""

import base64
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SECRETS = {"WANDB_API_KEY": "wandbkeysentinel" + "0" * 24, "HF_TOKEN": "hf_tokensentinel0123456789",
           "netrc": "netrcsentinel" + "1" * 27}


def _forms(secret: str) -> list[bytes]:
    raw = secret.encode()
    return [raw] + [base64.b64encode(raw[i:])[4:-4] for i in range(3)]   # at any byte offset


def test_no_secret_is_written_under_the_output_folder(tmp_path):
    home, out = tmp_path / "home", tmp_path / "run"
    home.mkdir()
    (home / ".netrc").write_text(f"machine api.wandb.ai\n  login user\n  password {SECRETS['netrc']}\n")
    (home / ".netrc").chmod(0o600)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "WANDB_MODE", "NETRC")}
    env.update(HOME=str(home), WANDB_API_KEY=SECRETS["WANDB_API_KEY"], HF_TOKEN=SECRETS["HF_TOKEN"])
    done = subprocess.run(
        [sys.executable, "-m", "tsp_trainer", "train", "recipes/tiny_cpu.yaml", "parallel.tsp_degree=1",
         "train.steps=2", "optim.warmup_steps=1", "checkpoint.every=2", "train.eval_every=0",
         "data.seq_len=64", f"train.output_dir={out}", "logging.progress_bar=false",
         "logging.wandb_mode=offline"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    files = [p for p in out.rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"config.yaml", "run.json", "metrics.jsonl", "manifest.json", "rank_00000.pt"} <= names
    assert any(p.suffix == ".wandb" for p in files) and any(p.name == "debug.log" for p in files)
    leaks = [f"{p.relative_to(out)} holds {key}" for p in files for key, secret in SECRETS.items()
             if any(form in p.read_bytes() for form in _forms(secret))]
    assert leaks == []
