"""Weights sharded by DeepSpeed ZeRO-3 over every rank of the axis x dp: schemes `sp` and `ulysses`
with `sharded_weights` (parallel/baselines/apply.py sp_groups). DeepSpeed (engine/deepspeed.py,
parallel/mpu.py ShardedWeightsMpu) partitions each parameter over the W = D x dp ranks, gathers it
for each use and reduce-scatters its gradient over the same W ranks; the layers sum no gradient over
the axis themselves.

What gathers together: a module's call gathers the parameters it holds (its own, recurse=False;
norms, embedding, LM head), or, for the GATHER_UNITS (DeepSpeed "leaf" modules), all parameters
under it at once (attention: q/k/v/o and biases; MLP: gate/up/down), whose forward reads the
holders' weights without calling them. Each gathered unit is released after its call (reuse
distance 0, engine/deepspeed.py ZERO3_SETTINGS) and gathered again for its backward.

The ops are DeepSpeed's, so the ledger gets them by their closed form (`Zero3Traffic`), per
micro-batch forward + backward, W ranks, one parameter of n elements padded to W x ceil(n / W):

| tag                    | op             | bytes (this rank)                                              |
|------------------------|----------------|----------------------------------------------------------------|
| zero3.params           | all_gather     | sum over the forward's gathered units of W ceil(n/W) x elt     |
|                        |                | (+ every block's units again in a checkpointed replay)         |
| zero3.params.backward  | all_gather     | the same units once more, for their backward (after a replay,  |
|                        |                | less each block's last unit, its MLP: still gathered)          |
| zero3.grads            | reduce_scatter | sum over distinct parameters of W ceil(n/W) x 4 (fp32)         |

On one rank nothing is gathered (the partition is the whole parameter); the reduce-scatter still
runs. A tied embedding is gathered by both its users (embedding and LM head) and reduced once.
tests/distributed/test_sharded_weights.py checks these against the bytes DeepSpeed hands to
torch.distributed."""

from __future__ import annotations

import math

import torch.nn as nn

from tsp_trainer.parallel.baselines.layers import ParallelAttention, ParallelMLP
from tsp_trainer.parallel.comm import Comm
from tsp_trainer.parallel.grad_sync import GRAD_BYTES

# Modules whose parameters DeepSpeed gathers all at once at their call (set_z3_leaf_modules).
GATHER_UNITS = (ParallelAttention, ParallelMLP)


def gather_units(module: nn.Module) -> list[list[nn.Parameter]]:
    """The parameter sets one forward of `module` gathers, one per module call, in module order."""
    if isinstance(module, GATHER_UNITS):
        return [list(module.parameters())]
    own = list(module.parameters(recurse=False))
    units = [own] if own else []
    for child in module.children():
        units += gather_units(child)
    return units


class Zero3Traffic:
    """The closed form above for one model on `world` ranks (the Comm ZeRO-3 partitions over).
    Built before DeepSpeed partitions the parameters (their shapes are read here); records nothing
    unless `enabled` (the run is under ZeRO-3)."""

    def __init__(self, model: nn.Module, world: Comm, *, enabled: bool = True):
        self.world, self.enabled = world, enabled
        w = world.size

        def padded_bytes(p: nn.Parameter, element: int) -> int:
            return w * math.ceil(p.numel() / w) * element

        def unit_bytes(units) -> int:
            return sum(padded_bytes(p, p.element_size()) for unit in units for p in unit)

        units = gather_units(model)
        layers = getattr(model, "layers", None)
        blocks = [gather_units(block) for block in layers] if layers is not None else []
        # one rank: DeepSpeed gathers nothing (the partition is the parameter), reduces all the same
        gathers = w > 1
        self.forward_bytes = unit_bytes(units) if gathers else 0
        self.replay_bytes = sum(unit_bytes(b) for b in blocks) if gathers else 0
        # the replay's last unit of each block (its MLP) is still gathered when its backward starts
        self.resident_after_replay = sum(unit_bytes(b[-1:]) for b in blocks) if gathers else 0
        self.grad_bytes = sum(padded_bytes(p, GRAD_BYTES) for p in model.parameters() if p.requires_grad)
        self.dtype = str(next(model.parameters()).dtype).removeprefix("torch.")

    def record(self, *, checkpointed: bool = False, backward: bool = True) -> None:
        """One micro-batch: the forward's gathers and, with `backward`, the backward's gathers and
        the gradients' reduce-scatter. `checkpointed`: the blocks run under activation
        checkpointing, replayed once in the backward."""
        if not self.enabled:
            return
        c = self.world
        replay = checkpointed and backward
        c.ledger.record("all_gather", axis=c.axis, tag="zero3.params", group_size=c.size,
                        nbytes=self.forward_bytes + (self.replay_bytes if replay else 0), dtype=self.dtype)
        if backward:
            c.ledger.record("all_gather", axis=c.axis, tag="zero3.params.backward", group_size=c.size,
                            nbytes=self.forward_bytes - (self.resident_after_replay if replay else 0),
                            dtype=self.dtype)
            c.ledger.record("reduce_scatter", axis=c.axis, tag="zero3.grads", group_size=c.size,
                            nbytes=self.grad_bytes, dtype="float32")
