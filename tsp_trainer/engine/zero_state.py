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
    return step if _is_cpu_adam(optimizer) else torch.tensor(float(step))


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
