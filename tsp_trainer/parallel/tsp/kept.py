"""What a TSP block keeps from its forward for its backward, and where (parallel/tsp/attention.py,
mlp.py).

Without activation checkpointing: what `parallel.tsp_recompute` keeps (the attention items under
selective and none, the MLP's gate/up pre-activations under none), on the autograd node, only when
grad is enabled. Under activation checkpointing the block's replay in backward is the recompute in
every mode: the first forward keeps nothing, and the replay keeps what
`parallel.checkpoint_replay_keeps` allows (all: items and gate/up; attention: items only; nothing)
and puts it in the checkpointed call's slot, keyed by the layer's settings, where that block's
backward takes it. A part kept as None is recomputed. The modes side by side: docs/parallelism.md,
"`parallel.tsp_recompute`".
"""

from __future__ import annotations

import typing

import torch

from tsp_trainer.model.activation_checkpoint import CheckpointCall, checkpoint_pass


class Kept(typing.NamedTuple):
    """Decided in the module's forward (where grad mode is the caller's), read by the autograd
    function."""

    items: bool                       # this forward records what backward would recompute
    call: CheckpointCall | None       # under activation checkpointing: the call's slots
    replay: bool = False              # the replay (puts into call); else the first forward (takes)

    @property
    def first_forward(self) -> bool:
        """The first forward of a checkpointed call: what it saves is dropped (its replay saves)."""
        return self.call is not None and not self.replay

    def store(self, ctx, key: object, value) -> None:
        """End of the function's forward: `value` (None when items is False) goes on ctx, or into
        the call's slot for `key` (the replay); the first forward under checkpointing records the
        call on ctx for its backward to take from."""
        ctx.kept_call, ctx.kept = (None, value) if self.call is None else (self.call, None)
        if self.replay:
            self.call.put(key, value)

    @staticmethod
    def load(ctx, key: object):
        """Start of the function's backward: what its forward (or its block's replay) kept, or None
        (recompute everything)."""
        call, kept = ctx.kept_call, ctx.kept
        ctx.kept_call = ctx.kept = None
        return call.take(key) if call is not None else kept


def kept_for_backward(mode_keeps: bool, replay_keeps: bool = True) -> Kept:
    """What this forward keeps: `mode_keeps` says whether the block's tsp_recompute mode keeps
    its activations without checkpointing; `replay_keeps` whether, under activation
    checkpointing, the block's replay keeps them (parallel.checkpoint_replay_keeps). A replay
    that keeps nothing puts None, and the backward recomputes as full recompute does."""
    current = checkpoint_pass()
    if current is not None:
        return Kept(items=current.replay and replay_keeps, call=current.call, replay=current.replay)
    return Kept(items=mode_keeps and torch.is_grad_enabled(), call=None)
