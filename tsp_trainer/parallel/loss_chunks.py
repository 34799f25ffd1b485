"""How many local tokens the LM head's loss (`parallel.loss_chunk_tokens`), the gated MLP
(`parallel.mlp_chunk_tokens`) and TSP attention's K/V chunks (`parallel.attention_chunk_tokens`)
take at a time.

Why: the vocab-parallel loss makes fp32 logits [tokens, V/D] and the MLP gate/up intermediates
[tokens, I/D] with about MLP_ALIVE_INTERMEDIATES of them alive in backward; for all local tokens
at once both grow with the sequence. In chunks they are [chunk, V/D] and [chunk, I/D]; "auto"
tiles only when the block would exceed a bound. Standard library only (the planner uses the same
rule).
"""

from __future__ import annotations

import math

# Without a budget, "auto" keeps the fp32 logits block of one chunk at or under 1 GiB.
DEFAULT_LOGITS_BLOCK_BYTES = 1 << 30
# Without a budget, "auto" keeps one chunk's MLP intermediates (all of them together) at or under
# 1 GiB too.
DEFAULT_MLP_BLOCK_BYTES = 1 << 30
FP32_BYTES = 4
# [tokens, I/D] tensors of one MLP block alive at once in its backward (g, u, silu(g), the
# product, dp, dg/du; plan/transients.py counts the same 6)
MLP_ALIVE_INTERMEDIATES = 6


def auto_chunk_tokens(local_tokens: int, bytes_per_token: int, bound: int) -> int:
    """All `local_tokens` (no tiling) when their block of `bytes_per_token` bytes a token fits
    `bound`, else the fewest equal chunks whose block fits it (at least one token per chunk)."""
    if local_tokens <= 0 or local_tokens * bytes_per_token <= bound:
        return max(local_tokens, 1)
    most = max(1, bound // bytes_per_token)                   # tokens whose block fits the bound
    chunks = math.ceil(local_tokens / most)
    return math.ceil(local_tokens / chunks)                   # balanced: no small last chunk


def auto_loss_chunk_tokens(local_tokens: int, vocab_shard: int, budget_bytes: int | None = None) -> int:
    """Tokens per chunk for `local_tokens` tokens against a `vocab_shard`-row vocabulary shard: all
    of them (no tiling) when their fp32 logits block [local_tokens, vocab_shard] fits
    `budget_bytes` (None: DEFAULT_LOGITS_BLOCK_BYTES), else the fewest equal chunks whose block
    fits it (at least one token per chunk)."""
    bound = DEFAULT_LOGITS_BLOCK_BYTES if budget_bytes is None else budget_bytes
    return auto_chunk_tokens(local_tokens, FP32_BYTES * vocab_shard, bound)


def auto_mlp_chunk_tokens(local_tokens: int, inter_shard: int, elem_bytes: int,
                          budget_bytes: int | None = None) -> int:
    """Tokens per chunk of a gated MLP block of `inter_shard` intermediate channels (I/D) whose
    activations have `elem_bytes` bytes an element: all of them when the MLP_ALIVE_INTERMEDIATES
    [local_tokens, inter_shard] intermediates fit `budget_bytes` (None: DEFAULT_MLP_BLOCK_BYTES),
    else the fewest equal chunks whose intermediates fit it."""
    bound = DEFAULT_MLP_BLOCK_BYTES if budget_bytes is None else budget_bytes
    return auto_chunk_tokens(local_tokens, MLP_ALIVE_INTERMEDIATES * elem_bytes * inter_shard, bound)


def _forced_chunk(key: str, setting, local_tokens: int) -> int:
    """A token count given for `key`: checked, and at most local_tokens (a chunk larger than the
    tokens is one chunk)."""
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise ValueError(f"parallel.{key}={setting!r} must be 'auto' or an integer >= 1")
    return max(1, min(setting, local_tokens))


def resolve_loss_chunk_tokens(setting: int | str, local_tokens: int, vocab_shard: int,
                              budget_bytes: int | None = None) -> int:
    """The chunk the loss uses: `setting` is "auto" (auto_loss_chunk_tokens) or a token count
    (at most local_tokens: a chunk larger than the tokens is one chunk)."""
    if setting == "auto":
        return auto_loss_chunk_tokens(local_tokens, vocab_shard, budget_bytes)
    return _forced_chunk("loss_chunk_tokens", setting, local_tokens)


def resolve_mlp_chunk_tokens(setting: int | str, local_tokens: int, inter_shard: int,
                             elem_bytes: int, budget_bytes: int | None = None) -> int:
    """The chunk a gated MLP block uses: `setting` is "auto" (auto_mlp_chunk_tokens) or a token
    count (at most local_tokens)."""
    if setting == "auto":
        return auto_mlp_chunk_tokens(local_tokens, inter_shard, elem_bytes, budget_bytes)
    return _forced_chunk("mlp_chunk_tokens", setting, local_tokens)


def token_chunks(tokens: int, chunk: int) -> list[slice]:
    """The slices of [0, tokens) the loss (or an MLP block) takes in turn, `chunk` tokens each
    (the last may be shorter)."""
    return [slice(start, min(start + chunk, tokens)) for start in range(0, tokens, chunk)]


def in_vocab_shard(ids, start: int, rows: int):
    """(ids - start clamped into [0, rows), mask of the ids the shard of `rows` rows from `start`
    holds): the clamped index is valid everywhere, the mask says where it means anything (no
    boolean selection, so no host sync on CUDA)."""
    local = ids - start
    hit = (local >= 0) & (local < rows)
    return local.clamp(0, rows - 1), hit


def mask_vocab_padding(logits, start: int, vocab_size: int | None):
    """logits [..., rows] of the vocabulary rows start.., in place: the columns of padding rows
    (index >= vocab_size, config.model.padded_vocab_size) set to -inf, so they get no probability
    and no gradient; host ints only (no sync). Returns logits."""
    if vocab_size is not None and vocab_size - start < logits.shape[-1]:
        logits[..., max(vocab_size - start, 0):] = float("-inf")
    return logits


# Without a budget, "auto" chunks an item's K/V only when its gathered [B, S, 2, H_b, d] exceeds
# this (the unchunked path holds it, its dK/dV and their scatter copy at once).
DEFAULT_KV_BLOCK_BYTES = 1 << 30


def auto_attention_chunk_tokens(local_tokens: int, gathered_bytes_per_token: int,
                                bound: int | None = None) -> int:
    """Local tokens per K/V chunk: all of them (unchunked) when the gathered K/V block
    (`gathered_bytes_per_token` bytes a local token: D ranks x 2 x H_b x d x element size) fits
    `bound` (None: DEFAULT_KV_BLOCK_BYTES), else the fewest equal chunks whose block fits it."""
    return auto_chunk_tokens(local_tokens, gathered_bytes_per_token,
                             DEFAULT_KV_BLOCK_BYTES if bound is None else bound)


def resolve_attention_chunk_tokens(setting: int | str, local_tokens: int, gathered_bytes_per_token: int,
                                   bound: int | None = None) -> int:
    """The chunk an item uses (local tokens; >= local_tokens means unchunked): `setting` is "auto"
    or a token count."""
    if setting == "auto":
        return auto_attention_chunk_tokens(local_tokens, gathered_bytes_per_token, bound)
    return _forced_chunk("attention_chunk_tokens", setting, local_tokens)


__all__ = ["DEFAULT_KV_BLOCK_BYTES", "DEFAULT_LOGITS_BLOCK_BYTES", "DEFAULT_MLP_BLOCK_BYTES", "MLP_ALIVE_INTERMEDIATES",
           "auto_attention_chunk_tokens", "auto_chunk_tokens", "auto_loss_chunk_tokens", "auto_mlp_chunk_tokens", "in_vocab_shard",
           "mask_vocab_padding",
           "resolve_attention_chunk_tokens", "resolve_loss_chunk_tokens", "resolve_mlp_chunk_tokens", "token_chunks"]
