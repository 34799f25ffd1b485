"""Rank functions and a single-process reference loop for the Trainer tests."""

from __future__ import annotations

import contextlib
import logging
import tempfile
from pathlib import Path

import torch

from tsp_trainer.config import load_config
from tsp_trainer.data import build_loader, load_tokenizer
from tsp_trainer.model import Transformer
from tsp_trainer.optim import build_optimizer, build_scheduler

REPO = Path(__file__).resolve().parents[2]
RECIPE = str(REPO / "recipes" / "tiny_cpu.yaml")
FAST = [f"data.source={REPO / 'data' / 'corpus'}", f"data.tokenizer={REPO / 'data' / 'tokenizer'}",
        "data.seq_len=64", "data.micro_batch_size=2", "train.eval_every=0",
        "logging.progress_bar=false", "optim.warmup_steps=2", "optim.lr=3e-3"]


# Runs that name no train.output_dir write here, never into the checkout's runs/tiny_cpu (which the
# README's main job fills: a test there would meet a used output folder). Made once per pytest
# process; forked ranks inherit it.
DEFAULT_OUTPUT_DIR = tempfile.mkdtemp(prefix="tsp_trainer_tests_")


def config(overrides):
    overrides = list(overrides)
    if not any(o.startswith("train.output_dir=") for o in overrides):
        overrides.append(f"train.output_dir={DEFAULT_OUTPUT_DIR}")
    return load_config(RECIPE, FAST + overrides)


@contextlib.contextmanager
def captured_log():
    """Inside the block, the list fills with every message the tsp_trainer loggers of this process
    emit at INFO and above (on a rank != 0 the Trainer's INFO lines are dropped before that)."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("tsp_trainer")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def record_wandb() -> dict:
    """Replace wandb.init in this process by a recorder (wandb 0.31 has no reader for its offline
    files): the returned dict fills with the run's "config", its "defined" metrics and the
    (step, metrics) pairs "logged"."""
    import wandb

    seen = {"defined": {}, "logged": []}

    class Run:
        def define_metric(self, name, summary=None):
            seen["defined"][name] = summary

        def log(self, metrics, step):
            seen["logged"].append((step, metrics))

        def finish(self):
            pass

    def init(**kwargs):
        seen["config"] = kwargs["config"]
        return Run()
    wandb.init = init
    return seen


def train_rank(rank, world, overrides, return_weights=True):
    from tsp_trainer.engine.zero_state import whole_parameters
    from tsp_trainer.trainer import Trainer

    trainer = Trainer(config(overrides), world_size=world, global_rank=rank)
    history = trainer.fit()
    weights = None
    if return_weights:
        with whole_parameters(trainer.par.model):           # ZeRO-3 (sp, ulysses): gathered
            weights = {k: v.clone() for k, v in trainer.par.gather_full_state_dict().items()}
    return {"losses": [h["train/loss"] for h in history], "grad_norms": [h["train/grad_norm"] for h in history],
            "skipped": [h["train/skipped"] for h in history], "weights": weights if rank == 0 else None,
            "dp_world_size": trainer.engine.dp_world_size, "step": trainer.state.step,
            "zero_optimizer": _zero_optimizer(trainer.engine),
            "recompute": getattr(trainer.par.model.layers[0].self_attn, "recompute", None)}


def _zero_optimizer(engine) -> dict:
    """What DeepSpeed steps: its ZeRO wrapper's class, the optimizer it wraps, and whether the
    fp32 partitions live on the host (ZeRO 1/2 say so in `cpu_offload`, ZeRO-3 in
    `offload_optimizer`)."""
    zero = engine.optimizer
    return {"wrapper": type(zero).__name__, "optimizer": type(engine.basic_optimizer).__name__,
            "offloaded": bool(getattr(zero, "cpu_offload", False) or getattr(zero, "offload_optimizer", False))}


def assert_matches_reference(outs, reference) -> None:
    """Every rank's losses (rtol 1e-6) and rank 0's clipped gradient norms (rtol 1e-5) and weights
    (rtol 1e-5, atol 1e-4, and 99.9% of the elements within 1e-6 + 1e-5 |w|) equal
    reference_run's (losses, weights, norms); the tolerances are argued by the callers."""
    import pytest

    ref_losses, ref_weights, ref_norms = reference
    assert outs[0]["grad_norms"] == pytest.approx(ref_norms, rel=1e-5)
    for o in outs:
        assert o["losses"] == pytest.approx(ref_losses, rel=1e-6)
    close, total = 0, 0
    for name, w in ref_weights.items():
        got = outs[0]["weights"][name]
        torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-4, msg=name)
        close += int(((got - w).abs() <= 1e-6 + 1e-5 * w.abs()).sum())
        total += w.numel()
    assert close / total > 0.999
    assert ref_losses[-1] < ref_losses[0]                       # it trains


def reference_run(overrides, *, dp_degree: int):
    """One process, plain PyTorch: the same init, optimizer, schedule and clipping, on the global
    batch formed by concatenating what each DP rank's loader yields."""
    cfg = config(overrides)
    model = Transformer(cfg.model.to_model_config())
    model.init_weights(cfg.model.seed)
    opt = build_optimizer(model, cfg.optim)
    sched = build_scheduler(opt, cfg.optim, cfg.train.steps)
    tok = load_tokenizer(cfg.data.tokenizer)
    loaders = [build_loader(cfg.data.source, tokenizer=tok, seq_len=cfg.data.seq_len,
                            micro_batch_size=cfg.data.micro_batch_size, dp_rank=r,
                            dp_degree=dp_degree, seed=cfg.train.seed) for r in range(dp_degree)]
    losses, norms = [], []
    for _ in range(cfg.train.steps):
        batches = [next(loader) for loader in loaders]
        ids = torch.cat([b["input_ids"] for b in batches])
        labels = torch.cat([b["labels"] for b in batches])
        loss = model.loss(ids, labels)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(
            model.parameters(), cfg.optim.max_grad_norm if cfg.optim.max_grad_norm > 0 else float("inf"))))
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def assert_resume_as_matches_uninterrupted(first: str, then: str, tmp_path, first_overrides=(),
                                           then_overrides=()) -> None:
    """A 5-step run of parallel.scheme=`first` (with `first_overrides`) on 4 ranks (the recipe's
    DP 2 x D 2) saves step 3; resuming it as `then` (with `then_overrides`) trains steps 4 and 5
    like the uninterrupted run: the same losses (rtol 1e-6: fp32 summation order) and final
    weights (the tolerances of test_trainer.py)."""
    import pytest

    from tests.helpers.dist import run_on_ranks

    common = ["train.steps=5", "checkpoint.keep_last=5"]
    full = run_on_ranks(train_rank, 4, common + [f"parallel.scheme={first}", "checkpoint.every=3",
                                                 f"train.output_dir={tmp_path / 'a'}", *first_overrides],
                        timeout=600)
    step3 = tmp_path / "a" / "checkpoints" / "step_00000003"
    resumed = run_on_ranks(train_rank, 4, common + [f"parallel.scheme={then}", f"train.resume={step3}",
                                                    f"train.output_dir={tmp_path / 'b'}", *then_overrides],
                           timeout=600)
    assert resumed[0]["step"] == 5
    assert resumed[0]["losses"] == pytest.approx(full[0]["losses"][3:], rel=1e-6)
    close, total = 0, 0
    for name, w in full[0]["weights"].items():
        got = resumed[0]["weights"][name]
        torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-4, msg=name)
        close += int(((got - w).abs() <= 1e-6 + 1e-5 * w.abs()).sum())
        total += w.numel()
    assert close / total > 0.999
