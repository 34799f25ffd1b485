"""model/activation_checkpoint.py: the pass a checkpointed block runs in, and the slots that carry
what its replay computed to its backward (parallel/tsp/kept.py uses them)."""

from __future__ import annotations

import pytest
import torch

from tsp_trainer.model.activation_checkpoint import CheckpointCall, checkpoint_pass, checkpointed_block


class _Recorder(torch.nn.Module):
    """A block that records the pass it runs in and hands a value from its replay to itself."""

    def __init__(self):
        super().__init__()
        self.passes = []

    def forward(self, x, rope):
        current = checkpoint_pass()
        self.passes.append(None if current is None else current.replay)
        if current is not None and current.replay:
            current.call.put(self, "from the replay")
            assert current.call.take(self) == "from the replay" and current.call.pending() == 0
        return (x * 2).sin()


def test_the_first_forward_and_the_replay_are_told_apart():
    block, x = _Recorder(), torch.randn(3, requires_grad=True)
    y = checkpointed_block(block, x, None)
    assert block.passes == [False] and checkpoint_pass() is None
    y.sum().backward(retain_graph=True)
    y.sum().backward()                             # a second backward replays again
    assert block.passes == [False, True, True]
    block(x, None)                                 # outside a checkpoint
    with torch.no_grad():                          # torch runs it as a plain forward: no pass
        checkpointed_block(block, x, None)
    assert block.passes[3:] == [None, None]


def test_a_slot_is_put_once_and_taken_once():
    call, key = CheckpointCall(), torch.nn.Linear(1, 1)
    with pytest.raises(RuntimeError, match="the backward of Linear found nothing put by its block's replay"):
        call.take(key)
    call.put(key, 1)
    with pytest.raises(RuntimeError, match="the replay of Linear found its previous replay's results not taken"):
        call.put(key, 2)
    assert call.take(key) == 1 and call.pending() == 0
