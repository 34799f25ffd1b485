"""Sequence-length schedule: short sequences first, the full context later (e.g. 8K -> 32K -> 128K).

A schedule is a list of stages (first optimizer step, seq_len, micro_batch_size); a stage lasts
until the next one starts, the last one to the end of the run. The loader asks for the shape of
micro-batch b (b = step * grad_accum + micro-step), so batches queued ahead by the prefetch worker
and batches replayed after a resume have the shape of the step they belong to. The token stream is
plain tokens between windows, so nothing is lost or repeated at a stage boundary: the next window
is simply cut longer. Rules (config/validate.py checks them before start-up): stages start at step
0 and in increasing order, and every seq_len satisfies the scheme's split rule (2D | seq_len for
TSP's zigzag) and fits the model. Imports nothing but the standard library.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class LengthStage:
    start_step: int          # first optimizer step (0-based) of this stage
    seq_len: int             # tokens per sequence
    micro_batch_size: int    # sequences per DP rank per micro-step


class LengthSchedule:
    """Shape (seq_len, micro_batch_size) of each micro-batch of the run."""

    def __init__(self, stages: Iterable[LengthStage], *, batches_per_step: int = 1):
        self.stages = sorted(stages, key=lambda s: s.start_step)
        if not self.stages or self.stages[0].start_step != 0:
            raise ValueError("a length schedule needs a stage starting at step 0, got "
                             f"{[s.start_step for s in self.stages]}")
        starts = [s.start_step for s in self.stages]
        if len(set(starts)) != len(starts):
            raise ValueError(f"length schedule stages start at the same step twice: {starts}")
        for s in self.stages:
            if s.seq_len < 1 or s.micro_batch_size < 1:
                raise ValueError(f"length schedule stage {s} needs seq_len and micro_batch_size >= 1")
        if batches_per_step < 1:
            raise ValueError(f"batches_per_step={batches_per_step} must be >= 1")
        self._starts = starts
        self.batches_per_step = batches_per_step

    @classmethod
    def constant(cls, seq_len: int, micro_batch_size: int) -> "LengthSchedule":
        return cls([LengthStage(0, seq_len, micro_batch_size)])

    def stage_at(self, step: int) -> LengthStage:
        """The stage of 0-based optimizer step `step`."""
        return self.stages[bisect.bisect_right(self._starts, max(step, 0)) - 1]

    def shape_of_batch(self, batch_index: int) -> tuple[int, int]:
        """(seq_len, micro_batch_size) of the 0-based micro-batch `batch_index` of the run."""
        stage = self.stage_at(batch_index // self.batches_per_step)
        return stage.seq_len, stage.micro_batch_size

    def seq_len_at(self, step: int) -> int:
        return self.stage_at(step).seq_len

    @property
    def max_seq_len(self) -> int:
        return max(s.seq_len for s in self.stages)

    def to_list(self) -> list[list[int]]:
        return [[s.start_step, s.seq_len, s.micro_batch_size] for s in self.stages]
