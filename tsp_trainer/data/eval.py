"""Held-out batches for evaluation: the same micro-batches at every evaluation, from a loader
built once (no dataset reopened and re-tokenized at each evaluation).

The first evaluation reads and packs `num_batches` micro-batches and, when they hold at most
`cache_max_tokens` tokens, keeps them (int64: 4 x 128K tokens are 4 MiB); later evaluations reuse
them without touching the data. Larger evaluations rewind the loader to its saved start instead.
A split shorter than `num_batches` wraps around, so every DP rank yields exactly `num_batches`
(an evaluation that all-reduces per batch must not have one rank stop early). Imports torch.
"""

from __future__ import annotations

from typing import Iterator

import torch

from tsp_trainer.data.loader import PackedLoader

CACHE_MAX_TOKENS = 1 << 26      # 64M tokens = 512 MiB of int64 at most


class EvalBatches:
    """Iterate it for this DP rank's evaluation micro-batches (identical at every evaluation)."""

    def __init__(self, loader: PackedLoader, *, num_batches: int,
                 cache_max_tokens: int = CACHE_MAX_TOKENS):
        if num_batches < 1:
            raise ValueError(f"train.eval_batches={num_batches} must be >= 1")
        self.loader, self.num_batches = loader, num_batches
        self._start = loader.state_dict()
        self._cache: list[dict[str, torch.Tensor]] | None = None
        self._cache_max_tokens = cache_max_tokens
        self.reads = 0                 # times the data was read (1 when cached)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if self._cache is not None:
            yield from self._cache
            return
        self.loader.load_state_dict(self._start)      # rewind (and reopen) the held-out stream
        self.reads += 1
        batches, tokens = [], 0
        try:
            for _ in range(self.num_batches):
                batch = next(self.loader)
                tokens += batch["input_ids"].numel()
                if tokens <= self._cache_max_tokens:
                    batches.append(batch)
                yield batch
        finally:
            self.loader.close()                        # no reader stays open between evaluations
        if len(batches) == self.num_batches:
            self._cache = batches

    def close(self) -> None:
        self.loader.close()
