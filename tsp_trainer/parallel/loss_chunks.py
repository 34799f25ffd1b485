"""How many local tokens the LM head's loss takes at a time (`parallel.loss_chunk_tokens`).

The vocab-parallel loss (TSP's vocab ring, parallel/tsp/vocab.py; the baselines' cross-entropy,
parallel/baselines/megatron.py) computes fp32 logits of a block of tokens against this rank's
vocabulary shard: [tokens, V/D]. For all local tokens at once that block grows with the sequence
(2.7M tokens on 8 ranks with a 128K vocabulary: 22 GB), so the loss takes the tokens in chunks
and the block is [chunk, V/D]. "auto" tiles only when the block would exceed a bound.

Standard library only (the planner, plan/, uses the same rule); `in_vocab_shard` takes tensors
but needs no import of torch.
"""

from __future__ import annotations

import math

# Without a budget, "auto" keeps the fp32 logits block of one chunk at or under 1 GiB.
DEFAULT_LOGITS_BLOCK_BYTES = 1 << 30
FP32_BYTES = 4


def auto_loss_chunk_tokens(local_tokens: int, vocab_shard: int, budget_bytes: int | None = None) -> int:
    """Tokens per chunk for `local_tokens` tokens against a `vocab_shard`-row vocabulary shard: all
    of them (no tiling) when their fp32 logits block [local_tokens, vocab_shard] fits
    `budget_bytes` (None: DEFAULT_LOGITS_BLOCK_BYTES), else the fewest equal chunks whose block
    fits it (at least one token per chunk)."""
    bound = DEFAULT_LOGITS_BLOCK_BYTES if budget_bytes is None else budget_bytes
    if local_tokens <= 0 or FP32_BYTES * local_tokens * vocab_shard <= bound:
        return max(local_tokens, 1)
    most = max(1, bound // (FP32_BYTES * vocab_shard))        # tokens whose block fits the bound
    chunks = math.ceil(local_tokens / most)
    return math.ceil(local_tokens / chunks)                   # balanced: no small last chunk


def resolve_loss_chunk_tokens(setting: int | str, local_tokens: int, vocab_shard: int,
                              budget_bytes: int | None = None) -> int:
    """The chunk the loss uses: `setting` is "auto" (auto_loss_chunk_tokens) or a token count
    (at most local_tokens: a chunk larger than the tokens is one chunk)."""
    if setting == "auto":
        return auto_loss_chunk_tokens(local_tokens, vocab_shard, budget_bytes)
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise ValueError(f"parallel.loss_chunk_tokens={setting!r} must be 'auto' or an integer >= 1")
    return max(1, min(setting, local_tokens))


def token_chunks(tokens: int, chunk: int) -> list[slice]:
    """The slices of [0, tokens) the loss takes in turn, `chunk` tokens each (the last may be
    shorter)."""
    return [slice(start, min(start + chunk, tokens)) for start in range(0, tokens, chunk)]


def in_vocab_shard(ids, start: int, rows: int):
    """(ids - start clamped into [0, rows), mask of the ids the shard of `rows` rows from `start`
    holds): the clamped index is valid everywhere, the mask says where it means anything (no
    boolean selection, so no host sync on CUDA)."""
    local = ids - start
    hit = (local >= 0) & (local < rows)
    return local.clamp(0, rows - 1), hit


__all__ = ["DEFAULT_LOGITS_BLOCK_BYTES", "auto_loss_chunk_tokens", "in_vocab_shard",
           "resolve_loss_chunk_tokens", "token_chunks"]
