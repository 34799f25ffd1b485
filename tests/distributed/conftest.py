"""Runs shared by several test modules: each trained once per session, then only read."""

from __future__ import annotations

import pytest

from tests.helpers.dist import run_on_ranks

# Evaluation during training on DP 2 x TSP 2: passkey at every step, eval/loss at step 2.
PASSKEY = ["eval.passkey_every=1", "eval.passkey_lengths=[128,160]", "eval.passkey_depths=[0,0.5,1]",
           "eval.passkey_samples=3", "eval.passkey_digits=3"]
EVALUATED_RUN = ["train.steps=2", "optim.warmup_steps=1", "train.eval_every=2", "train.eval_batches=3",
                 *PASSKEY]


@pytest.fixture(scope="session")
def evaluated_run(tmp_path_factory):
    """A tiny model trained 2 steps under DP=2 x TSP=2 (4 ranks, checkpoint step_00000002) with the
    Trainer's evaluations on (EVALUATED_RUN): its run folder. test_eval_trainer reads its metrics;
    tsp-eval (test_eval_cli) and tsp-export (test_hf_interop) read its checkpoint. Read-only."""
    from tests.distributed.trainer_cases import train_rank

    out = tmp_path_factory.mktemp("run")
    run_on_ranks(train_rank, 4, [*EVALUATED_RUN, f"train.output_dir={out}"], False)
    return out
