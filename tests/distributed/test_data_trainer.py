"""The data pipeline inside the Trainer on 4 CPU processes (DP=2 x TSP=2): a sequence-length
schedule (the FLOP count and data/seq_len follow the stage), the prefetch worker, eval batches
read once, data/epoch; and a resume across a stage boundary equal to the uninterrupted run."""

import pytest

from tests.distributed.trainer_cases import config
from tsp_trainer.observability.flops import flops_per_token
from tests.helpers.dist import run_on_ranks

pytestmark = pytest.mark.distributed

# 6 steps: 3 at 32 tokens x 4 sequences, then 3 at 64 x 2 (the same tokens per step).
SCHEDULE = ["train.steps=6", "data.seq_len=64", "data.prefetch=2", "train.eval_every=3",
            "train.eval_batches=2", "checkpoint.every=3", "checkpoint.keep_last=5",
            "data.seq_len_schedule=[{start_step: 0, seq_len: 32, micro_batch_size: 4}, "
            "{start_step: 3, seq_len: 64, micro_batch_size: 2}]"]


def _data_rank(rank, world, overrides):
    from tsp_trainer.trainer import Trainer

    trainer = Trainer(config(overrides), world_size=world, global_rank=rank)
    history = trainer.fit()
    evals = trainer.eval_batches
    # FLOPs per token the metrics used: TFLOP/s per device x devices / tokens per second.
    fpt = [h["perf/tflops_per_gpu"] * 1e12 * world / h["perf/tokens_per_s"] for h in history]
    return {"losses": [h["train/loss"] for h in history], "seq_len": [h["data/seq_len"] for h in history],
            "flops_per_token": fpt, "model": trainer.model_cfg,
            "epoch": [h["data/epoch"] for h in history],
            "eval": [h.get("eval/loss") for h in history], "eval_reads": evals.reads if evals else None,
            "tokens": trainer.state.tokens_seen}


def test_length_schedule_prefetch_and_eval_in_the_trainer(tmp_path):
    full = run_on_ranks(_data_rank, 4, SCHEDULE + [f"train.output_dir={tmp_path / 'full'}"])
    out = full[0]
    assert out["seq_len"] == [32, 32, 32, 64, 64, 64]
    # MFU's FLOP count followed the stage (attention grows with the sequence).
    expected = [flops_per_token(out["model"], s) for s in out["seq_len"]]
    assert out["flops_per_token"] == pytest.approx(expected, rel=1e-6)
    assert expected[3] > expected[2]
    assert out["tokens"] == 6 * 2 * 4 * 32            # dp 2 x 128 tokens per step
    assert out["eval"][2] is not None and out["eval"][5] is not None and out["eval_reads"] == 1
    assert out["epoch"][0] > 0 and out["epoch"] == sorted(out["epoch"])
    assert all(o["losses"] == out["losses"] for o in full)   # every rank reports the global loss

    # Resume from step 3 (the next step is the first at 64 tokens; the prefetch queue had
    # already cut 64-token batches): the same losses as the uninterrupted run.
    step3 = tmp_path / "full" / "checkpoints" / "step_00000003"
    resumed = run_on_ranks(_data_rank, 4, SCHEDULE + [f"train.output_dir={tmp_path / 'resumed'}",
                                                      f"train.resume={step3}"])[0]
    assert resumed["losses"] == out["losses"][3:]
    assert resumed["seq_len"] == [64, 64, 64]


def test_training_on_tsp_tokenize_output_equals_training_on_text(tmp_path):
    """The Trainer on `tsp-tokenize` output (no tokenizing in the run) gives the text run's
    losses bit for bit, on 2 DP ranks (one output file per source file keeps the split)."""
    from tests.distributed.trainer_cases import REPO
    from tsp_trainer.data.tokenize_cli import main as tokenize_main

    out = tmp_path / "corpus_tok"
    assert tokenize_main([str(REPO / "data" / "corpus"), str(out), "--tokenizer",
                          str(REPO / "data" / "tokenizer")]) == 0
    common = ["parallel.tsp_degree=1", "train.steps=4", "checkpoint.enabled=false",
              "data.shuffle=true", "data.shuffle_buffer=16"]
    text = run_on_ranks(_data_rank, 2, common + [f"train.output_dir={tmp_path / 'text'}"])[0]
    tokens = run_on_ranks(_data_rank, 2, common + [f"train.output_dir={tmp_path / 'tok'}",
                                                   f"data.source={out}"])[0]
    assert tokens["losses"] == text["losses"]
