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
(Transformer.blocks_per_call), and `checkpointed_segment` runs each block as `checkpointed_block`
but keeps only the segment's input (on the device, or on the host under activation offload): the
inner blocks' inputs, which their checkpoints save, are dropped in forward (`_SegmentInputs`). In
backward, the first inner input asked for (the last block's) re-runs the segment's blocks but the
last without grad from the kept input, and stashes each inner input it regains: on the device, or
under offload in host memory (model/offload.py `stash`), fetched back for its own block's backward.
Then each block is replayed and backpropagated as under per-block checkpointing. Cost: k - 1 more
block forwards per segment; block inputs kept: ceil(L / k) instead of L, plus up to k - 1 regained
ones while the segment is backpropagated (on the device without offload, on the host with it). The
same values are computed in the same order (the re-run is the first forward's computation, no
randomness in a block), so losses and gradients equal per-block checkpointing's (tests/distributed/
test_nested_checkpoint.py).

The re-run is written here rather than as torch's nested non-reentrant checkpoint: torch's outer
checkpoint keeps what its recompute saves, the inner checkpoints' inputs, in its own frame on the
device (its recomputation hook stores them for the holders of the first forward), and a
saved_tensors_hooks pushed inside that recompute would take those saves from it.
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


def checkpointed_segment(segment, x: torch.Tensor, rope, host=None):
    """block_wrapper(segment, x, rope) for nested checkpointing: the blocks of the segment (a
    BlockSegment of model/transformer.py) as `checkpointed_block`, only the segment's input kept
    (module docstring). host: activation offload's store of this call (model/offload.py), which
    keeps the segment input and stashes the regained inner inputs in host memory; None keeps all
    on the device."""
    if not torch.is_grad_enabled() or len(segment) == 1:
        return segment(x, rope, checkpointed_block)
    inputs = _SegmentInputs(segment, rope, host)
    for j, block in enumerate(segment.blocks):
        with torch.autograd.graph.saved_tensors_hooks(inputs.packer(j), inputs.unpack):
            x = checkpointed_block(block, x, rope)
    return x


class _SegmentInputs:
    """The block inputs of one segment that its blocks' checkpoints save (each saves exactly its
    input x: the RoPE tables are no tensor argument): the first kept (by `host` or as is), the
    inner ones dropped in forward and regained by one re-run of the segment in backward."""

    def __init__(self, segment, rope, host):
        self.segment, self.rope, self.host = segment, rope, host
        self.first = None                       # the kept segment input, as packed
        self.regained: dict[int, object] = {}   # inner index j -> its input (packed when offloaded)
        self.stash = None

    def packer(self, j: int):
        def pack(t: torch.Tensor):
            if t.numel() == 0:            # the checkpoint's empty marker tensor (saved on CUDA)
                return ("kept", t)
            if j > 0:
                return ("inner", j)
            self.first = t if self.host is None else self.host.pack(t)
            return ("first",)
        return pack

    def unpack(self, packed) -> torch.Tensor:
        if packed[0] == "kept":
            return packed[1]
        return self._unpack(0 if packed[0] == "first" else packed[1])

    def _unpack(self, j: int) -> torch.Tensor:
        if j == 0:                        # the store refuses a second unpack (a second backward)
            return self.first if self.host is None else self.host.unpack(self.first)
        if j not in self.regained:        # the segment's first unpack in this backward
            if self.stash is not None:
                raise RuntimeError("train.offload_activations: a saved tensor was unpacked twice (a "
                                   "second backward through the same graph, retain_graph=True): not "
                                   "supported")
            self._rerun()
        value = self.regained.pop(j)
        if self.host is None:
            return value
        if self.host.owner.prefetch_next and j - 1 in self.regained:
            self.stash.fetch(self.regained[j - 1])    # the next block's input, fetched ahead
        return self.stash.unpack(value)

    def _rerun(self) -> None:
        """The segment's blocks but the last, without grad, from the kept input; each output (the
        next block's input) stashed: [B, T, h] per block."""
        x = self.first if self.host is None else self.host.peek(self.first)
        if self.host is not None:
            self.stash = self.host.owner.stash(x.device)
        with torch.no_grad():
            for j, block in enumerate(self.segment.blocks[:-1], start=1):
                x = block(x, self.rope)
                self.regained[j] = x if self.stash is None else self.stash.pack(x)


def wrap_blocks(model, *, checkpointing: bool, offload: bool, segment_blocks: int = 1,
                prefetch: bool = True) -> None:
    """Set `model.block_wrapper` and `model.blocks_per_call` (model/transformer.py) for
    train.activation_checkpointing, train.offload_activations, train.checkpoint_segment_blocks and
    train.offload_prefetch: per-block checkpointing, or segments of `segment_blocks` blocks whose
    inner inputs are regained in backward, and the offload of what they keep (model/offload.py)
    around either."""
    from tsp_trainer.model.offload import ActivationOffload

    if segment_blocks < 1 or (segment_blocks > 1 and not checkpointing):
        raise ValueError(f"train.checkpoint_segment_blocks={segment_blocks} needs activation "
                         "checkpointing (nested checkpoints are checkpoints) and must be >= 1")
    wrapper = None
    if checkpointing:
        wrapper = checkpointed_segment if segment_blocks > 1 else checkpointed_block
    model.blocks_per_call = segment_blocks
    model.block_wrapper = (ActivationOffload(wrapper, prefetch=prefetch, hands_store=segment_blocks > 1)
                           if offload else wrapper)
