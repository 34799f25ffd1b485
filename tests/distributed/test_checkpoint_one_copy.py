"""Checkpoints hold the training state once (the layout-free shards, no DeepSpeed files), written
and hashed by every rank, verified once by rank 0 at resume; async saves publish only complete checkpoints and
resume bit for bit (4 CPU processes)."""

import json
import re

import pytest
import torch

from tests.distributed.trainer_cases import captured_log, config, train_rank
from tests.helpers.dist import run_on_ranks
from tsp_trainer.checkpoint.disk_format import build_manifest, folder_bytes
from tsp_trainer.checkpoint.shards import read_full_state_dict

pytestmark = pytest.mark.distributed
RUN = ["train.steps=8", "checkpoint.every=2", "checkpoint.keep_last=10"]


def _history_rank(rank, world, overrides):
    from tsp_trainer.trainer import Trainer

    with captured_log() as log:
        trainer = Trainer(config(overrides), world_size=world, global_rank=rank)
        history = trainer.fit()
    weights = trainer.par.gather_full_state_dict()
    return {"history": history, "weights": weights if rank == 0 else None,
            "state_bytes": _state_bytes(trainer), "log": log}


def _state_bytes(trainer) -> int:
    """Bytes of the distinct training state: every parameter shard once (weights + the two fp32
    AdamW moments), summed over the model-parallel ranks of one replica."""
    mine = 0
    for name, p in trainer.par.model.named_parameters():
        replicated = trainer.par.specs[name].dim is None
        if replicated and trainer.mesh.tsp_rank != 0:
            continue
        mine += p.numel() * (p.element_size() + 8)
    return sum(trainer.mesh.tsp.all_gather_object(mine))


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sync")
    return run_on_ranks(_history_rank, 4, RUN + [f"train.output_dir={out}"]), out


def test_one_copy_of_the_state_written_and_hashed_by_every_rank(sync_run):
    outs, out = sync_run
    step = out / "checkpoints" / "step_00000008"
    assert sorted(p.name for p in step.iterdir()) == ["manifest.json", "meta.json", "model", "optim", "ranks"]
    files = {str(p.relative_to(step)): p.stat().st_size for p in step.rglob("*") if p.is_file()}
    state = outs[0]["state_bytes"]
    ratio = sum(files.values()) / state
    assert ratio <= 1.1, (ratio, files)
    # dp 2 x tsp 2: each dp rank of each tsp group writes one part of its group's shard
    assert sorted(f for f in files if f.startswith("model/")) == [
        f"model/model-tsp{t:03d}-of-002-part{d:03d}-of-002.safetensors" for t in (0, 1) for d in (0, 1)]
    # each tensor once: the moments of every parameter, whole, and the weights equal the run's
    weights = read_full_state_dict(step / "model")
    for name, w in outs[0]["weights"].items():
        assert torch.equal(weights[name], w), name
    optim = read_full_state_dict(step / "optim", "optim")
    assert set(optim) == {f"{k}/{n}" for n in outs[0]["weights"] for k in ("exp_avg", "exp_avg_sq")}
    # the manifest the ranks' own hashes built equals hashing the folder afresh
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest == json.loads(json.dumps(build_manifest(step)))


def _checkpoint_lines(log: list[str], checkpoints, how: str) -> None:
    """One line per checkpoint written: step, folder, its size on disk, seconds, sync or async."""
    lines = [line for line in log if "checkpoint: step" in line]
    assert len(lines) == 4, lines
    for line, step in zip(lines, (2, 4, 6, 8)):
        folder = checkpoints / f"step_{step:08d}"
        size = f"{folder_bytes(folder) / 2**20:.1f} MiB"
        assert re.fullmatch(rf"\[rank 0\] checkpoint: step {step} written to {re.escape(str(folder))} "
                            rf"\({re.escape(size)}, \d+\.\d s, {how}\)", line), line
    assert size != "0.0 MiB"


def test_start_up_phases_and_checkpoints_are_logged_on_rank_0(sync_run):
    """Rank 0 says each start-up phase with its seconds, in order, and each checkpoint written;
    the other ranks say neither."""
    outs, out = sync_run
    phases = [line for line in outs[0]["log"] if "start-up:" in line]
    assert [re.fullmatch(r"\[rank 0\] start-up: (.+) \(\d+\.\d s\)", p).group(1) for p in phases] == [
        "config checked and resolved", "process groups: 4 ranks = dp 2 x tsp 2",
        "model: 2 layers, parallel.scheme=tsp", "engine: DeepSpeed ZeRO-1 over dp 2",
        "data: training loader"]
    _checkpoint_lines(outs[0]["log"], out / "checkpoints", "sync")
    for o in outs[1:]:
        assert not [line for line in o["log"] if "start-up:" in line or "checkpoint: step" in line]


def test_async_save_same_checkpoints_and_exact_resume(sync_run, tmp_path):
    """checkpoint.async_save=true trains the same (losses bit for bit), publishes the same
    checkpoints (byte-identical state files), and resuming one equals the uninterrupted run."""
    outs, out = sync_run
    sync = outs[0]
    async_out = run_on_ranks(_history_rank, 4, RUN + [f"train.output_dir={tmp_path / 'a'}",
                                                      "checkpoint.async_save=true"])[0]
    assert [h["train/loss"] for h in async_out["history"]] == [h["train/loss"] for h in sync["history"]]
    ckpts = tmp_path / "a" / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == [f"step_{s:08d}" for s in (2, 4, 6, 8)]
    for step in ("step_00000004", "step_00000008"):
        mine = json.loads((ckpts / step / "manifest.json").read_text())["files"]
        theirs = json.loads((out / "checkpoints" / step / "manifest.json").read_text())["files"]
        state = [f for f in theirs if f.startswith(("model/", "optim/"))]
        assert {f: mine[f] for f in state} == {f: theirs[f] for f in state}
    _checkpoint_lines(async_out["log"], ckpts, "async")
    stalls = [h["perf/checkpoint_stall_s"] for h in async_out["history"]]
    assert all(s >= 0 for s in stalls) and sum(stalls) > 0
    resumed = run_on_ranks(train_rank, 4, RUN + [f"train.output_dir={tmp_path / 'b'}",
                                                 f"train.resume={ckpts / 'step_00000004'}"])[0]
    assert resumed["losses"] == [h["train/loss"] for h in sync["history"]][4:]
    for name, w in sync["weights"].items():
        assert torch.equal(resumed["weights"][name], w), name


def _hashing_rank(rank, world, overrides):
    """Build a Trainer that resumes; count the files this rank hashes while doing so."""
    import tsp_trainer.checkpoint.disk_format as disk_format
    from tsp_trainer.trainer import Trainer

    hashed = []
    real = disk_format.sha256_file
    disk_format.sha256_file = lambda path, *a, **k: hashed.append(path) or real(path, *a, **k)
    trainer = Trainer(config(overrides), world_size=world, global_rank=rank)
    disk_format.sha256_file = real
    return {"hashed": len(hashed), "step": trainer.state.step}


def test_resume_is_verified_once_by_rank_0_before_start_up(sync_run, tmp_path):
    """Rank 0 hashes every file of the manifest once, in the input checks; the other ranks hash
    nothing and resume from rank 0's choice; loading adds no second pass."""
    import shutil

    _, out = sync_run
    step = tmp_path / "step_00000008"
    shutil.copytree(out / "checkpoints" / "step_00000008", step)
    files = json.loads((step / "manifest.json").read_text())["files"]
    resumed = run_on_ranks(_hashing_rank, 4, RUN + [f"train.output_dir={tmp_path / 'r'}",
                                                    f"train.resume={step}"])
    assert [r["hashed"] for r in resumed] == [len(files), 0, 0, 0]
    assert [r["step"] for r in resumed] == [8, 8, 8, 8]
