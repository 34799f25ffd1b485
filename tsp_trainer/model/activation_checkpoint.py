"""Activation checkpointing (`train.activation_checkpointing`) as a `block_wrapper`
(model/transformer.py): each decoder block keeps only its input for backward."""

from __future__ import annotations

import torch
import torch.utils.checkpoint


def checkpointed_block(block, x: torch.Tensor, rope):
    """block_wrapper(block, x, rope). Non-reentrant checkpointing re-runs the block's forward (and
    its collectives, in the same order on every rank) during backward."""
    return torch.utils.checkpoint.checkpoint(block, x, rope, use_reentrant=False)
