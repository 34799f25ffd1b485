"""Activation checkpointing (`train.activation_checkpointing`) as a `block_wrapper`
(model/transformer.py): each decoder block keeps only its input for backward.

Code inside a block can ask which pass of a checkpointed call it runs in (`checkpoint_pass`):
the first forward (keep nothing beyond what checkpointing keeps), or the replay in backward
(whose results the backward of the same block is about to use). A layer that computes in its
replay what its backward would otherwise recompute hands it over through the call's slots
(`CheckpointCall.put` in the replay, `take` in the first forward's backward), so its backward
recomputes nothing again. The model itself uses none of this; parallel/tsp does.

Nested checkpointing (`train.checkpoint_segment_blocks` = k > 1; Chen et al. 2016's sqrt(L)
checkpointing with a chosen k): the model hands the wrapper segments of k consecutive blocks
(Transformer.blocks_per_call), and `checkpointed_segment` keeps only each segment's input (on the
device, or on the host under activation offload). In backward, torch's nested non-reentrant
checkpoint re-runs the segment's forward from that input to regain its inner block inputs (the
inner checkpoints' inputs are tensors the outer one saved), stopping at the last block's input,
then each block is replayed and backpropagated as under plain per-block checkpointing. Cost: k - 1
more block forwards per segment; block inputs kept: ceil(L / k) instead of L, plus up to k - 1
regained ones on the device while the segment is backpropagated. The same values in the same
order are computed, so losses and gradients equal per-block checkpointing's (tests/distributed/
test_nested_checkpoint.py).
"""

from __future__ import annotations

import contextvars
import typing

import torch
import torch.utils.checkpoint


class CheckpointCall:
    """One checkpointed call of a block. Its slots carry what the replay computed to the backward
    of the first forward's autograd nodes: the replay puts, that backward takes (once per
    backward through the call; a second backward with retain_graph replays and puts again)."""

    def __init__(self):
        self._slots: dict[object, object] = {}

    def put(self, key: object, value: object) -> None:
        """Replay: hand `value` to the backward of the node keyed `key` (e.g. its module)."""
        if key in self._slots:
            raise RuntimeError(f"activation checkpoint: the replay of {type(key).__name__} found its "
                               "previous replay's results not taken by a backward")
        self._slots[key] = value

    def take(self, key: object) -> object:
        """Backward of the node keyed `key`: what this call's replay put for it (removed)."""
        if key not in self._slots:
            raise RuntimeError(f"activation checkpoint: the backward of {type(key).__name__} found "
                               "nothing put by its block's replay")
        return self._slots.pop(key)

    def pending(self) -> int:
        """How many slots are filled and not taken yet."""
        return len(self._slots)


class CheckpointPass(typing.NamedTuple):
    """The pass of a checkpointed call that code is running in."""

    call: CheckpointCall
    replay: bool          # False: the first forward (grad enabled); True: the replay in backward


_PASS: contextvars.ContextVar[CheckpointPass | None] = contextvars.ContextVar(
    "activation_checkpoint_pass", default=None)


def checkpoint_pass() -> CheckpointPass | None:
    """The checkpointed call and pass running now, or None outside a checkpointed block (and in
    a checkpointed block run without grad: torch then runs it as a plain forward)."""
    return _PASS.get()


class _InPass:
    """Context manager setting `checkpoint_pass()` for one pass; re-entrant, since the recompute
    context is entered again by every replay of the call."""

    def __init__(self, call: CheckpointCall, replay: bool):
        self.value = CheckpointPass(call, replay)
        self._tokens: list[contextvars.Token] = []

    def __enter__(self):
        self._tokens.append(_PASS.set(self.value))

    def __exit__(self, *exc):
        _PASS.reset(self._tokens.pop())
        return False


def _pass_contexts() -> tuple[_InPass, _InPass]:
    """torch.utils.checkpoint's context_fn: called once per checkpointed call, so each call gets
    its own slots."""
    call = CheckpointCall()
    return _InPass(call, replay=False), _InPass(call, replay=True)


def checkpointed_block(block, x: torch.Tensor, rope):
    """block_wrapper(block, x, rope). Non-reentrant checkpointing re-runs the block's forward (and
    its collectives, in the same order on every rank) during backward, with `checkpoint_pass()`
    telling the two passes apart."""
    return torch.utils.checkpoint.checkpoint(block, x, rope, use_reentrant=False,
                                             context_fn=_pass_contexts)


def checkpointed_segment(segment, x: torch.Tensor, rope):
    """block_wrapper(segment, x, rope) for nested checkpointing: the segment (a BlockSegment of
    model/transformer.py) is checkpointed as a whole, each of its blocks as `checkpointed_block`."""
    return torch.utils.checkpoint.checkpoint(segment, x, rope, checkpointed_block, use_reentrant=False)


def wrap_blocks(model, *, checkpointing: bool, offload: bool, segment_blocks: int = 1) -> None:
    """Set `model.block_wrapper` and `model.blocks_per_call` (model/transformer.py) for
    train.activation_checkpointing, train.offload_activations and train.checkpoint_segment_blocks:
    per-block checkpointing, or segments of `segment_blocks` blocks checkpointed around per-block
    checkpoints, and the offload of what they keep (model/offload.py) around either."""
    from tsp_trainer.model.offload import ActivationOffload

    if segment_blocks < 1 or (segment_blocks > 1 and not checkpointing):
        raise ValueError(f"train.checkpoint_segment_blocks={segment_blocks} needs activation "
                         "checkpointing (nested checkpoints are checkpoints) and must be >= 1")
    wrapper = None
    if checkpointing:
        wrapper = checkpointed_segment if segment_blocks > 1 else checkpointed_block
    model.blocks_per_call = segment_blocks
    model.block_wrapper = ActivationOffload(wrapper) if offload else wrapper
