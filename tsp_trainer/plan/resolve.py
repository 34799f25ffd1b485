"""The training path's one entry into the planner: a recipe's `auto` memory settings resolved to
concrete values, and the recompute its FLOP count needs, decided once for the whole job.

    resolved = resolve_run(cfg, world_size=world, cuda=cuda)   # AutoSettingsError: nothing fits
    resolved.cfg            # no `auto` left in the memory keys (plan/auto.py)
    resolved.line()         # the start-up line, or None when nothing was auto
    resolved.flops          # {seq_len: (model, hardware) FLOPs per token} of every length stage

Who calls it, once: the launcher's one-process input check (tsp-launch, `check`, a one-process
tsp-train), or global rank 0 after its device is set, whose answer every rank then takes
(run/startup.py). Every rank reading its own memory figure would let two ranks choose different
modes, buckets or chunks, and their collectives would no longer match.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from tsp_trainer.config import TrainConfig, resolve_config
from tsp_trainer.observability.flops import flops_per_token
from tsp_trainer.plan.auto import (AutoSettingsError, MemoryChoice, choose_auto_settings, choose_bench_settings,
                                   length_stages)
from tsp_trainer.plan.flops import run_recompute


@dataclass(frozen=True)
class Resolved:
    """A run's settings as every rank runs them (picklable: rank 0 broadcasts it)."""

    cfg: TrainConfig                         # resolve_config'ed, the memory keys concrete
    memory: MemoryChoice | None              # what `auto` chose (None: nothing was auto)
    flops: dict[int, tuple[float, float]]    # seq_len -> (model, hardware) FLOPs per token

    def line(self) -> str | None:
        return None if self.memory is None else self.memory.line()

    def facts(self) -> dict:
        """The W&B run facts of the choice ({} when nothing was auto)."""
        return {} if self.memory is None else {"auto": self.memory.facts()}

    def flops_at(self, seq_len: int) -> tuple[float, float]:
        return self.flops[seq_len]


def resolve_run(cfg: TrainConfig, *, world_size: int, cuda: bool, device=None,
                refuses: Callable[[TrainConfig], None] | None = None) -> Resolved:
    """`cfg` with dtype, model dims and the `auto` memory settings resolved on this process's
    device (plan/auto.py `choose_auto_settings`), and its FLOPs per token at each stage's length.
    refuses: raises ValueError for a config this device cannot run."""
    cfg = resolve_config(cfg, world_size=world_size, cuda=cuda)
    memory = choose_auto_settings(cfg, world_size=world_size, cuda=cuda, device=device, refuses=refuses)
    if memory is not None:
        cfg = memory.apply(cfg)
    if cfg.parallel.checkpoint_replay_keeps == "auto":      # no checkpointing: nothing to replay
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, checkpoint_replay_keeps="all"))
    if cfg.parallel.ulysses_head_chunks == "auto":          # no ulysses over D > 1: nothing to split
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, ulysses_head_chunks=1))
    if cfg.train.checkpoint_segment_blocks == "auto":       # no checkpointing: nothing to nest
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, checkpoint_segment_blocks=1))
    if cfg.train.offload_prefetch == "auto":                # no offload: nothing to fetch
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, offload_prefetch=True))
    if cfg.train.attention_gqa == "auto":                   # no GQA-native path here: SDPA's own call
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, attention_gqa="fused"))
    model = cfg.model.to_model_config()
    flops = {seq: (flops_per_token(model, seq), flops_per_token(model, seq, recompute=run_recompute(cfg, model, seq)))
             for seq in sorted({s for s, _ in length_stages(cfg)})}
    return Resolved(cfg, memory, flops)


__all__ = ["AutoSettingsError", "MemoryChoice", "Resolved", "choose_bench_settings", "resolve_run"]
