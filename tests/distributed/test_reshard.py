"""Resuming a DP=2 x TSP=2 checkpoint under DP=1 x TSP=4 and DP=4 x TSP=1: model weights (biases
included), AdamW moments and step count, LR schedule, step counter and tokens seen carry over
(4 CPU processes)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.distributed.trainer_cases import config
from tests.helpers.dist import run_on_ranks
from tsp_trainer.checkpoint import reshard
from tsp_trainer.checkpoint.disk_format import build_manifest
from tsp_trainer.checkpoint.shards import read_extra, read_full_state_dict
from tsp_trainer.data import build_loader, load_tokenizer

pytestmark = pytest.mark.distributed

# MHA so that D=4 divides the KV heads; 5 scheduled steps, the checkpoint is taken at step 3.
# Every bias kind (sharded q/k/v, gate/up; replicated o, down) and a scaled RoPE, so that their
# shard specs, moments and resharding are covered too.
COMMON = ["model.num_kv_heads=4", "train.steps=5", "checkpoint.keep_last=5", "model.qkv_bias=true",
          "model.o_bias=true", "model.mlp_bias=true", "model.rope_scaling.rope_type=yarn",
          "model.rope_scaling.factor=4", "model.rope_scaling.original_max_position_embeddings=16"]
GLOBAL_BATCH = 4          # sequences per step in every layout: micro_batch_size x dp


class _FixedBatches:
    """Stands in for the trainer's loader: this DP rank's rows of fixed global batches. state_dict
    is the real loader's, so the final save still works."""

    def __init__(self, batches, dp_rank: int, dp: int, real):
        rows = GLOBAL_BATCH // dp
        self.it = iter([{k: v[dp_rank * rows:(dp_rank + 1) * rows] for k, v in b.items()} for b in batches])
        self.real = real

    def __next__(self):
        return next(self.it)

    @property
    def stats(self):
        return self.real.stats

    def state_dict(self):
        return self.real.state_dict()


def _fixed_global_batches(n: int = 2):
    """Two global batches of the validation split (not seen in training), one dp=1 stream."""
    cfg = config([])
    loader = build_loader(cfg.data.source, tokenizer=load_tokenizer(cfg.data.tokenizer),
                          seq_len=cfg.data.seq_len, micro_batch_size=GLOBAL_BATCH,
                          split="validation", dp_rank=0, dp_degree=1, seed=0)
    return [next(loader) for _ in range(n)]


def _resume_rank(rank, world, overrides, batches):
    from tsp_trainer.trainer import Trainer

    trainer = Trainer(config(overrides), world_size=world, global_rank=rank)
    resumed = (trainer.state.step, trainer.state.tokens_seen)
    if batches is not None:
        trainer.loader = _FixedBatches(batches, trainer.mesh.dp_rank, trainer.mesh.dims.dp, trainer.loader)
    history = trainer.fit()
    weights = trainer.par.gather_full_state_dict()
    return {"losses": [h["train/loss"] for h in history], "lrs": [h["train/lr"] for h in history],
            "resumed": resumed, "end": (trainer.state.step, trainer.state.tokens_seen),
            "weights": weights if rank == 0 else None}


def _layout(tsp: int, stage: int, out) -> list[str]:
    return COMMON + [f"parallel.tsp_degree={tsp}", f"data.micro_batch_size={GLOBAL_BATCH * tsp // 4}",
                     f"zero.stage={stage}", f"train.output_dir={out}"]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """DP=2 x TSP=2, ZeRO-1: 5 scheduled steps, checkpoint at step 3."""
    out = tmp_path_factory.mktemp("source")
    run_on_ranks(_resume_rank, 4, _layout(2, 1, out) + ["checkpoint.every=3"], None)
    return out / "checkpoints" / "step_00000003"


@pytest.fixture(scope="module")
def reference(source, tmp_path_factory):
    """The original layout resumed through DeepSpeed's own files (bit-exact, see test_trainer.py)."""
    out = tmp_path_factory.mktemp("reference")
    result = run_on_ranks(_resume_rank, 4, _layout(2, 1, out) + [f"train.resume={source}"],
                          _fixed_global_batches())[0]
    return result, out / "checkpoints" / "step_00000005"


@pytest.mark.parametrize("tsp,stage", [(4, 1), (1, 2)], ids=["dp1_tsp4_zero1", "dp4_tsp1_zero2"])
def test_resume_under_another_layout_matches_original(source, reference, tmp_path, tsp, stage):
    """Resume the step-3 checkpoint under another layout, train steps 4 and 5, and compare with the
    original layout resumed from the same checkpoint on the same batches.

    Comparable batches: with data.on_layout_change=restart each layout restarts its own stream,
    but DP=1, 2 and 4 deal documents to different ranks and pack them differently, so "restart
    in both" would still compare different batches. Instead both runs (after the real resume,
    which must accept the DP change) train on the same two fixed global batches, each DP rank
    taking its rows (global batch 4 = micro x dp in every layout). Step 4's loss then measures
    the loaded weights; step 5's loss and the final weights measure the update, which depends
    on the loaded moments, Adam step count and LR (dropping the moments or resetting the step
    moves step 5's loss by ~1e-3 relative and weights by ~1e-3, measured).

    Tolerances: only fp32 summation order differs (DP all-reduce over 1/2/4 partial sums, TSP
    ring order): losses rel 1e-6 (measured 2e-8); weights rtol 1e-5 / atol 1e-6 (measured max
    abs 5e-8); the LR schedule, step counter and tokens seen are equal exactly. The dp4 case runs
    ZeRO-2 (a stage change too), and its final checkpoint's layout-free optimizer shards,
    gathered under ZeRO-2 with 4 DP partitions, must match the reference's: rtol 1e-5, atol 1e-5
    of each moment's largest value (measured max abs diff 2e-7 of it)."""
    ref, ref_ckpt = reference
    out = tmp_path / "run"
    got = run_on_ranks(_resume_rank, 4, _layout(tsp, stage, out) + [
        f"train.resume={source}", "data.on_layout_change=restart"], _fixed_global_batches())[0]
    assert got["resumed"] == ref["resumed"] == (3, 3 * 256)
    assert got["end"] == ref["end"] == (5, 5 * 256)
    assert got["lrs"] == ref["lrs"]
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    for name, w in ref["weights"].items():
        # k_proj.bias: its gradient is zero in exact arithmetic (q . b_k adds the same score to
        # every key of a query: softmax ignores it), so AdamW turns fp32 rounding noise, which
        # depends on how each layout splits attention into calls (CPU prefix + diagonal merged by
        # log-sum-exp), into updates of up to lr: compared at that scale, not at 1e-6
        atol = 1e-3 if name.endswith("k_proj.bias") else 1e-6
        torch.testing.assert_close(got["weights"][name], w, rtol=1e-5, atol=atol, msg=name)
    ckpt = out / "checkpoints" / "step_00000005"
    assert read_extra(ckpt / "optim", "optim")["adam_steps"] == [5, 5]
    mine, theirs = read_full_state_dict(ckpt / "optim", "optim"), read_full_state_dict(ref_ckpt / "optim", "optim")
    assert mine.keys() == theirs.keys() and len(mine) == 2 * len(ref["weights"])   # 2 moments each
    for moment in ("exp_avg", "exp_avg_sq"):      # atol: 1e-5 of the moment's largest value
        keys = [k for k in theirs if k.startswith(moment + "/")]
        scale = max(float(theirs[k].abs().max()) for k in keys)
        for key in keys:
            torch.testing.assert_close(mine[key], theirs[key], rtol=1e-5, atol=1e-5 * scale, msg=key)


def test_layout_change_refused_by_default(source, tmp_path):
    """data.on_layout_change=refuse (the default) stops a resume under another DP degree."""
    with pytest.raises(RuntimeError) as err:
        run_on_ranks(_resume_rank, 4, _layout(1, 1, tmp_path / "run") + [f"train.resume={source}"], None)
    text = str(err.value)
    assert "dp_degree=2" in text and "dp_degree=4" in text and "data.on_layout_change" in text


def test_resume_of_another_model_shape_refused(source, tmp_path):
    with pytest.raises(RuntimeError) as err:
        run_on_ranks(_resume_rank, 1, _layout(1, 1, tmp_path / "run") + [
            f"train.resume={source}", "model.hidden_size=128", "data.micro_batch_size=4"], None)
    assert "another model shape" in str(err.value) and "model.hidden_size=128" in str(err.value)


def test_checkpoint_without_optimizer_shards_cannot_change_layout(source, tmp_path):
    """A checkpoint written before optim/ existed: a clear error, not a half-loaded state."""
    old = tmp_path / "step_00000003"
    shutil.copytree(source, old)
    shutil.rmtree(old / "optim")
    (old / "manifest.json").write_text(json.dumps(build_manifest(old)))
    with pytest.raises(ValueError, match="no layout-free optimizer state"):
        reshard.load_layout_free_state(old, None, None)


def test_local_slices_read_only_what_they_need(tmp_path):
    """read_local_state_dict under a new ShardSpec: D=4 -> 2, 2 -> 4 and 4 -> 1 along the stored dim,
    another split dim, and a replicated tensor; each equals the slice of the full tensor."""
    from tsp_trainer.checkpoint.shards import read_local_state_dict, shard_file_name, write_shard
    from tsp_trainer.parallel.apply import ShardSpec

    full = {"w": torch.arange(8 * 6, dtype=torch.float32).view(8, 6), "n": torch.arange(6.0)}
    old = {"w": ShardSpec(0, 4), "n": ShardSpec(None)}
    for r in range(4):
        write_shard(tmp_path / shard_file_name(r, 4), {k: old[k].local(v, r) for k, v in full.items()},
                    old, {"tsp": r})
    for new_w in (ShardSpec(0, 2), ShardSpec(0, 8), ShardSpec(0, 1), ShardSpec(1, 3)):
        specs = {"w": new_w, "n": ShardSpec(None)}
        for r in range(new_w.degree):
            got = read_local_state_dict(tmp_path, specs, {"tsp": r}, ["w", "n"])
            assert torch.equal(got["w"], new_w.local(full["w"], r)) and torch.equal(got["n"], full["n"])
