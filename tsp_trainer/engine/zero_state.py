"""ZeRO optimizer-state accessors for layout-free checkpoints (checkpoint/reshard.py): the engine
package is the only importer of deepspeed (DESIGN.md section 6).

ZeRO 1/2 and DeepSpeed's bf16 optimizer link each model parameter to its fragment of the flat
fp32 partition and set `param._hp_mapping` (None where this rank holds no fragment); the
safe_* helpers dispatch on that attribute, so do these. Without it (ZeRO-0, fp32) the torch
optimizer holds the state per parameter. tests/distributed/test_reshard.py fails if any of this
changes in a DeepSpeed upgrade.
"""

from __future__ import annotations

from collections import defaultdict

import torch


def get_full_optimizer_state(p: torch.nn.Parameter, optimizer, key: str) -> torch.Tensor:
    if hasattr(p, "_hp_mapping"):                # linked by ZeRO 1/2 (or DeepSpeed's bf16 optimizer)
        from deepspeed.utils import safe_get_full_optimizer_state

        return safe_get_full_optimizer_state(p, key)
    return optimizer.state[p][key].detach().clone()


def get_full_fp32(p: torch.nn.Parameter) -> torch.Tensor:
    from deepspeed.utils import safe_get_full_fp32_param

    full = safe_get_full_fp32_param(p) if hasattr(p, "_hp_mapping") else None
    return p.detach().float() if full is None else full


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
