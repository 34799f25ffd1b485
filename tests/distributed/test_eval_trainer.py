"""The Trainer's evaluations (tsp_trainer/eval through `self.evaluator.run(step)`) as a user reads
them in metrics.jsonl: eval/loss with its loss-by-position table at every train.eval_every step,
passkey accuracy with its (length, depth) table at every eval.passkey_every step, on DP 2 x TSP 2;
and the periodic passkey in training equals `tsp-eval passkey` on the checkpoint it saved."""

from __future__ import annotations

import json

import pytest

from tests.distributed.test_eval_cli import _cli_rank
from tests.helpers.dist import run_on_ranks

pytestmark = pytest.mark.distributed

@pytest.fixture(scope="module")
def run(evaluated_run):
    """tests/distributed/conftest.py's run (EVALUATED_RUN: 2 steps, eval_every 2, 3 eval batches,
    passkey every step at lengths 128 and 160, depths 0, 0.5 and 1, 3 samples of 3 digits)."""
    out = evaluated_run
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return out, {r["step"]: r for r in records}


def test_eval_metrics_in_metrics_jsonl(run):
    """Step 1: passkey only (eval_every=2); step 2: both. The position table covers every eval
    token once (3 batches x 2 sequences x 64 tokens x dp 2) and its token-weighted mean is eval/loss."""
    _, steps = run
    assert "eval/loss" not in steps[1] and "eval/passkey_accuracy" in steps[1]
    table = steps[2]["eval/loss_by_position"]
    assert table["columns"] == ["position_start", "position_end", "loss", "tokens"]
    assert [(r[0], r[1]) for r in table["rows"]] == [(0, 0), (1, 1), (2, 3), (4, 7), (8, 15),
                                                     (16, 31), (32, 63)]
    tokens = [r[3] for r in table["rows"]]
    assert tokens == [12, 12, 24, 48, 96, 192, 384]        # 12 sequences, every label valid
    mean = sum(r[2] * r[3] for r in table["rows"]) / sum(tokens)
    assert steps[2]["eval/loss"] == pytest.approx(mean, rel=1e-9)
    passkey = steps[2]["eval/passkey"]
    assert passkey["columns"] == ["length", "depth", "accuracy", "token_accuracy", "key_nll", "samples"]
    assert [(r[0], r[1], r[5]) for r in passkey["rows"]] == [
        (n, d, 3) for n in (128, 160) for d in (0.0, 0.5, 1.0)]
    accuracies = [r[2] for r in passkey["rows"]]
    assert steps[2]["eval/passkey_accuracy"] == pytest.approx(sum(accuracies) / len(accuracies))


def test_periodic_passkey_equals_tsp_eval_on_the_saved_checkpoint(run, tmp_path):
    """The last step's passkey table (DP 2 x TSP 2, samples split over dp) equals `tsp-eval
    passkey` on the checkpoint of that step, on one process: same haystacks, same predictions."""
    out, steps = run
    cli = run_on_ranks(_cli_rank, 1, ["passkey", str(out), "--lengths", "128,160", "--depths", "0,0.5,1",
                                      "--samples", "3", "--digits", "3", "--out", str(tmp_path)])[0]
    rows = steps[2]["eval/passkey"]["rows"]
    assert [(r[0], r[1], r[5]) for r in rows] == [(c.length, c.depth, c.samples) for c in cli.cells]
    for (_, _, accuracy, token_accuracy, key_nll, _), cell in zip(rows, cli.cells, strict=True):
        assert (accuracy, token_accuracy) == (cell.accuracy, cell.token_accuracy)
        assert key_nll == pytest.approx(cell.key_nll, rel=1e-5)
