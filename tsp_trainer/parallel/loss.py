"""The training loss: the mean over all valid tokens of the global batch.

Each rank computes the sum of its local token losses; the valid-token count is summed over the
given groups (tsp, and dp when the caller wants the global mean). Each rank backpropagates
local_sum / global_count: the sum over ranks of these is the global mean, and the TSP schedules
route every rank's partial gradients to the weights' owners, so no further scaling is needed."""

from __future__ import annotations

import torch

from tsp_trainer.parallel.comm import Comm


def global_count(count: torch.Tensor, comms: list[Comm]) -> torch.Tensor:
    total = count.detach().to(torch.float64).clone()
    for comm in comms:
        comm.all_reduce(total, tag="loss.count")
    return total


def reduce_loss_sum(local_sum: torch.Tensor, comms: list[Comm]) -> torch.Tensor:
    """The global loss sum (fp64, on the device, no autograd): no host read."""
    value = local_sum.detach().to(torch.float64).clone()
    for comm in comms:
        comm.all_reduce(value, tag="loss.value")
    return value


def reduce_loss_value(local_sum: torch.Tensor, total_count: torch.Tensor, comms: list[Comm]) -> float:
    """The global mean loss as a float (for logging; no autograd)."""
    return float(reduce_loss_sum(local_sum, comms) / total_count.clamp(min=1))
