"""ZeRO optimizer-state accessors for layout-free checkpoints (checkpoint/reshard.py), kept here
because the engine package is the only importer of deepspeed.

ZeRO 1/2 and DeepSpeed's bf16 optimizer link each model parameter to its fragment of the flat
fp32 partition and set `param._hp_mapping` (None where this rank holds no fragment; its
`lp_fragment_address` is the fragment's (start, numel) in the flattened parameter and
`get_hp_fragment(key)` the fragment itself); the safe_* helpers dispatch on that attribute, so do
these. Without it (ZeRO-0, fp32) the torch optimizer holds the state per parameter.
tests/distributed/test_reshard.py fails if any of this changes in a DeepSpeed upgrade.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch


def full_state_on_owner(p: torch.nn.Parameter, optimizer, key: str | None, *, dp, owner: int,
                        scratch: torch.Tensor) -> tuple[torch.Tensor | None, bool]:
    """p's full (TSP-local) fp32 state on dp rank `owner`, for a checkpoint: `key` is an optimizer
    state ("exp_avg", ...) or None for the fp32 master weights. Returns (tensor, in_scratch) on
    the owner, (None, False) elsewhere.

    ZeRO 1/2 (p._hp_mapping set): with dp = 1 the fragment is the whole tensor, returned as a view
    of the live partition (no copy, no communication). Otherwise each rank writes its fragment at
    its offset into `scratch` (flat fp32, >= p.numel(), zeroed first) and one SUM reduce over `dp`
    (the Comm) leaves the whole tensor on the owner: each element has exactly one non-zero
    contributor, so the sum is exact. DeepSpeed's safe_get_full_* do the same with a fresh buffer
    and an all-reduce; here the buffer is reused and only the writer receives. in_scratch: the
    result lives in `scratch` and must be copied before the next call. Without ZeRO the torch
    optimizer's own tensor (or the fp32 weight) is returned, live."""
    if not hasattr(p, "_hp_mapping"):
        if dp.rank != owner:
            return None, False
        return (optimizer.state[p][key] if key else p.detach().float()), False
    mapping = p._hp_mapping
    if dp.size == 1:
        return mapping.get_hp_fragment(key).view(p.shape), False
    flat = scratch[:p.numel()]
    flat.zero_()
    if mapping is not None:
        address = mapping.lp_fragment_address
        flat.narrow(0, address.start, address.numel).copy_(mapping.get_hp_fragment(key))
    dp.reduce(flat, owner, tag="checkpoint.gather")
    return (flat.view(p.shape), True) if dp.rank == owner else (None, False)


def set_full_fp32(p: torch.nn.Parameter, value: torch.Tensor) -> None:
    """ZeRO keeps an fp32 master partition beside the model weights: write this rank's fragment."""
    if hasattr(p, "_hp_mapping"):
        from deepspeed.utils import safe_set_full_fp32_param

        safe_set_full_fp32_param(p, value)


def set_full_optimizer_state(p, optimizer, key: str, value: torch.Tensor) -> None:
    if hasattr(p, "_hp_mapping"):
        from deepspeed.utils import safe_set_full_optimizer_state

        safe_set_full_optimizer_state(p, value, key)     # this rank's fragment only
    else:
        optimizer.state[p][key].copy_(value)


def link_optimizer_state(optimizer, params) -> None:
    """Point each ZeRO-linked parameter's fragment at its group's flat optimizer state, which
    safe_{get,set}_full_optimizer_state read and write. DeepSpeed 0.19.8 links every group once,
    right after group 0's first optimizer step (stage_1_and_2.py, _optimizer_step), when the
    torch optimizer has no state yet for groups 1.. (AdamW creates it lazily): their parameters
    then fail with "exp_avg not found in optimizer state fragment". Linking again is idempotent."""
    from deepspeed.utils import lazy_init_hp_params_optimizer_state

    by_group = defaultdict(list)
    for p in params:
        if getattr(p, "_hp_mapping", None) is not None:
            by_group[p._hp_mapping.param_group_index].append(p)
    for i, lp in by_group.items():
        lazy_init_hp_params_optimizer_state(lp, optimizer.param_groups[i]["params"][0], optimizer.state)


def _is_cpu_adam(optimizer) -> bool:
    """Whether `optimizer` is DeepSpeed's CPU Adam (zero.offload_optimizer=cpu)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return isinstance(optimizer, DeepSpeedCPUAdam)


def fresh_adam_step(optimizer, step: int):
    """The "step" entry of a new Adam state, in the type `optimizer` keeps it: a float tensor for
    torch AdamW, a Python int for DeepSpeedCPUAdam (its C++ op takes the count as an integer)."""
    return step if _is_cpu_adam(optimizer) else torch.tensor(float(step), device="cpu")   # host, as torch Adam keeps it


def replay_cpu_adam_steps(optimizer, step: int) -> None:
    """DeepSpeedCPUAdam's C++ op keeps beta1^t and beta2^t per optimizer in fp32, multiplied by
    beta once per step, and recomputes them with pow() when the count jumps (DeepSpeed 0.19.8
    csrc/includes/cpu_adam.h, IncrementStep), as the first update after a resume would: one
    rounding instead of t, so a resumed run would differ from the uninterrupted one in the last
    bits of its bias corrections. Counting 1..step through the op on empty tensors (no element
    updated) rebuilds the same products. No-op for any other optimizer."""
    if not _is_cpu_adam(optimizer) or step < 1:
        return
    group = optimizer.param_groups[0]
    beta1, beta2 = group["betas"]
    empty = torch.empty(0, dtype=torch.float32)
    for t in range(1, step + 1):
        optimizer.ds_opt_adam.adam_update(optimizer.opt_id, t, group["lr"], beta1, beta2, group["eps"],
                                          group["weight_decay"], group["bias_correction"], empty,
                                          empty, empty, empty)


# -- ZeRO-3 (schemes sp and ulysses: every parameter partitioned over all ranks) -------------------
# DeepSpeed 0.19.8 stage3.py: parameter p holds its partition of W x ceil(n / W) elements (padded)
# in p.ds_tensor, rank r the elements r*ceil(n/W).. of the flattened tensor; the fp32 master and
# the AdamW moments are the same slices of one flat fp32 tensor per sub-group
# (fp32_partitioned_groups_flat), whose optimizer state the torch optimizer keeps while its
# param_groups hold no parameter between steps. The safe_get/set_local_* helpers read and write
# this rank's slice; the full-tensor setters slice the value without the padding and fail on the
# last rank when W does not divide n, so the slices are cut here. With zero.offload_optimizer=cpu
# the flat fp32 partitions and their state are host tensors (stepped by DeepSpeedCPUAdam, its
# "step" a Python int): the same helpers read them (the getters copy to the compute device) and
# write them in place.


def is_zero3(p: torch.nn.Parameter) -> bool:
    return hasattr(p, "ds_id")


def local_weight(p: torch.nn.Parameter) -> torch.Tensor:
    """The values of p this rank holds: its ZeRO-3 partition, or p itself."""
    return p.ds_tensor if is_zero3(p) else p


def _zero3_local(p, key: str | None, *, weight: bool) -> torch.Tensor:
    """This rank's flat partition: the model weight (`weight`), the fp32 master (key None) or an
    optimizer state."""
    from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

    if weight:
        return p.ds_tensor.reshape(-1)
    local = safe_get_local_optimizer_state(p, key) if key else safe_get_local_fp32_param(p)
    return local.reshape(-1)


def zero3_full_on_owner(p: torch.nn.Parameter, key: str | None, *, world, owner: int,
                        scratch: torch.Tensor, weight: bool = False) -> tuple[torch.Tensor | None, bool]:
    """Collective over `world` (ZeRO-3's partition group, every rank, the same parameter order):
    p's full tensor, fp32, on world rank `owner`, as (tensor in `scratch`, True); (None, False)
    elsewhere. Each rank writes its partition at its offset into the zeroed scratch (fp32, >= W x
    ceil(n / W) elements) and one SUM reduce leaves the whole tensor on the owner (one non-zero
    contributor per element: exact; a bf16 weight comes back exactly through fp32)."""
    local = _zero3_local(p, key, weight=weight)
    n = local.numel()
    flat = scratch[:world.size * n]
    flat.zero_()
    flat.narrow(0, world.rank * n, n).copy_(local)
    world.reduce(flat, owner, tag="checkpoint.gather")
    if world.rank != owner:
        return None, False
    return flat[:p.ds_numel].view(p.ds_shape), True


def zero3_partition_of(p: torch.nn.Parameter, full: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank `rank`'s slice of `full` (p's whole value) as ZeRO-3 partitions it, padding included."""
    n = p.ds_tensor.numel()
    flat = full.reshape(-1)
    padded = torch.zeros(n * (rank + 1), dtype=full.dtype, device=full.device)
    stop = min(flat.numel(), n * (rank + 1))
    padded[:stop].copy_(flat[:stop])
    return padded[n * rank:]


def zero3_load(p: torch.nn.Parameter, weight: torch.Tensor, fp32: torch.Tensor,
               moments: dict[str, torch.Tensor], *, rank: int) -> None:
    """Write the partition of rank `rank` (this one, in ZeRO-3's group) of the model weight, the fp32 master and each moment (no
    communication); the moments' optimizer state must exist (zero3_init_adam_state)."""
    from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

    p.ds_tensor.copy_(zero3_partition_of(p, weight.to(p.ds_tensor.dtype), rank))
    safe_set_local_fp32_param(p, zero3_partition_of(p, fp32.float(), rank))
    for key, value in moments.items():
        safe_set_local_optimizer_state(p, zero3_partition_of(p, value.float(), rank), key)


def _zero3_subgroups(params) -> list[tuple[int, torch.Tensor]]:
    """(param group index, flat fp32 partition) of each ZeRO-3 sub-group."""
    z3 = next(p._z3_optimizer for p in params if is_zero3(p))
    return [(z3.sub_group_to_group_id[i], flat) for i, flat in enumerate(z3.fp32_partitioned_groups_flat)]


def zero3_adam_steps(optimizer, params) -> list[int]:
    """Adam's step count per param group under ZeRO-3 (0 before the first update)."""
    steps = [0] * len(optimizer.param_groups)
    for group, flat in _zero3_subgroups(params):
        state = optimizer.state.get(flat, {})
        steps[group] = max(steps[group], int(state["step"]) if "step" in state else 0)
    return steps


def zero3_init_adam_state(optimizer, params, steps: list[int], moments) -> None:
    """Create the optimizer state of each ZeRO-3 sub-group's flat fp32 partition, as AdamW's first
    step would."""
    for group, flat in _zero3_subgroups(params):
        optimizer.state[flat] = {"step": fresh_adam_step(optimizer, steps[group]),
                                 **{k: torch.zeros_like(flat) for k in moments}}


# A ds_active_sub_modules entry no module has: while it is there, DeepSpeed 0.19.8 releases no
# gathered parameter after a module call (partitioned_param_coordinator.py __release_param) and
# fetches none it finds available.
_HELD = -1


@contextlib.contextmanager
def whole_parameters(model: torch.nn.Module):
    """Inside the block every ZeRO-3 parameter of `model` is whole on every rank and stays so through
    module calls (collective: one gather over its partition group when the block starts; read-only,
    released unchanged at the end). The forward passes inside then communicate nothing for the
    weights, so the ranks may run different numbers of them (evaluation: each dp replica its own
    share of the batches). Without ZeRO-3 nothing happens."""
    params = [p for p in model.parameters() if is_zero3(p)]
    if not params:
        yield
        return
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    with GatheredParameters(params, modifier_rank=None):
        for p in params:
            p.ds_active_sub_modules.add(_HELD)
        try:
            yield
        finally:
            for p in params:
                p.ds_active_sub_modules.discard(_HELD)
