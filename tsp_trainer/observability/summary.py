"""The loss part of tsp-train's last line, from the run's history (one metrics dict per step run,
consecutive, ending at `last_step`). One step's training loss is one batch's: it moves by more than
the run improves over a few steps, so the line compares something steadier and says what it is:

    eval loss 5.9946 (step 20) -> 5.8646 (step 60)            the run evaluated (train.eval_every)
    eval loss 5.8646 (step 60)                                 ... once
    train loss 6.6201 -> 5.5402 (means of steps 1-10 and 51-60)   no evaluation: the mean of the
                                                               first and the last k logged losses
"""

from __future__ import annotations

EVAL_LOSS = "eval/loss"
MEAN_OF = 10


def loss_summary(history: list[dict], *, last_step: int, k: int = MEAN_OF) -> str:
    first_step = last_step - len(history) + 1
    evals = [(first_step + i, h[EVAL_LOSS]) for i, h in enumerate(history) if h.get(EVAL_LOSS) is not None]
    if evals:
        (s0, a), (s1, b) = evals[0], evals[-1]
        return f"eval loss {b:.4f} (step {s1})" if s0 == s1 else \
            f"eval loss {a:.4f} (step {s0}) -> {b:.4f} (step {s1})"
    k = min(k, max(1, len(history) // 2))
    losses = [h["train/loss"] for h in history]
    head, tail = sum(losses[:k]) / k, sum(losses[-k:]) / k
    if len(losses) == 1:
        return f"train loss {losses[0]:.4f} (step {last_step}, one batch)"
    return (f"train loss {head:.4f} -> {tail:.4f} (means of steps {_steps(first_step, k)} and "
            f"{_steps(last_step - k + 1, k)})")


def _steps(start: int, k: int) -> str:
    return str(start) if k == 1 else f"{start}-{start + k - 1}"
