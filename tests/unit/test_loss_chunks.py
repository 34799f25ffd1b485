"""The LM head's and the MLP's token chunks (parallel/loss_chunks.py): the "auto" rules, a forced
count, the slices."""

import pytest

from tsp_trainer.parallel.loss_chunks import (DEFAULT_LOGITS_BLOCK_BYTES, DEFAULT_MLP_BLOCK_BYTES,
                                              auto_loss_chunk_tokens, auto_mlp_chunk_tokens,
                                              resolve_loss_chunk_tokens, resolve_mlp_chunk_tokens,
                                              token_chunks)

GiB = 1 << 30


def test_auto_does_not_tile_a_block_under_the_bound():
    assert auto_loss_chunk_tokens(100, 10) == 100
    # 16,743 tokens x 16,032 rows x 4 B = 1,073,676,864 B <= 1 GiB: one chunk
    assert auto_loss_chunk_tokens(16_743, 16_032) == 16_743
    assert DEFAULT_LOGITS_BLOCK_BYTES == GiB


def test_auto_tiles_into_the_fewest_equal_chunks_under_the_bound():
    # one token more than fits: two halves
    assert auto_loss_chunk_tokens(16_744, 16_032) == 8_372
    # Llama 3 8B at 2,708,480 tokens on 8 ranks: 338,560 local tokens against 16,032 rows (21.7 GB
    # of fp32 logits): 21 chunks of at most 16,122 tokens, 1.03 GB each
    chunk = auto_loss_chunk_tokens(338_560, 16_032)
    assert chunk == 16_122
    assert 4 * chunk * 16_032 <= GiB
    assert len(token_chunks(338_560, chunk)) == 21


def test_auto_follows_a_given_budget():
    assert auto_loss_chunk_tokens(1000, 10, budget_bytes=40_000) == 1000     # exactly fits
    assert auto_loss_chunk_tokens(1000, 10, budget_bytes=39_999) == 500
    assert auto_loss_chunk_tokens(10, 100, budget_bytes=1) == 1             # at least one token
    # a budget above the default bound: no tiling where the default would tile
    assert auto_loss_chunk_tokens(338_560, 16_032, budget_bytes=32 * GiB) == 338_560


def test_a_forced_chunk_is_capped_at_the_tokens_and_checked():
    assert resolve_loss_chunk_tokens(5, 48, 64) == 5
    assert resolve_loss_chunk_tokens(4096, 48, 64) == 48
    assert resolve_loss_chunk_tokens("auto", 48, 64) == 48
    for bad in (0, -3, True, "big", 2.5):
        with pytest.raises(ValueError, match=r"parallel.loss_chunk_tokens=.* must be 'auto' or an integer >= 1"):
            resolve_loss_chunk_tokens(bad, 48, 64)


def test_token_chunks_cover_the_tokens_once():
    assert token_chunks(10, 4) == [slice(0, 4), slice(4, 8), slice(8, 10)]
    assert token_chunks(8, 8) == [slice(0, 8)]
    assert token_chunks(3, 5) == [slice(0, 3)]


def test_mlp_auto_does_not_tile_intermediates_under_the_bound():
    # 6 intermediates x 49,932 tokens x 1,792 channels x 2 B = 1,073,737,728 B <= 1 GiB: one
    # chunk; one token more: two
    assert DEFAULT_MLP_BLOCK_BYTES == GiB
    assert auto_mlp_chunk_tokens(49_932, 1_792, 2) == 49_932
    assert auto_mlp_chunk_tokens(49_933, 1_792, 2) == 24_967
    assert auto_mlp_chunk_tokens(100, 10, 4) == 100


def test_mlp_auto_tiles_llama_8b_at_long_context():
    # Llama 3 8B (I = 14,336) on 8 ranks, 925,696 local tokens (7.4M tokens): 19 bf16 chunks of
    # at most 48,721 tokens, their 6 [chunk, 1,792] intermediates under 1 GiB together
    chunk = auto_mlp_chunk_tokens(925_696, 1_792, 2)
    assert chunk == 48_721
    assert 6 * 2 * chunk * 1_792 <= GiB
    assert len(token_chunks(925_696, chunk)) == 19
    assert auto_mlp_chunk_tokens(925_696, 1_792, 2, budget_bytes=64 * GiB) == 925_696


def test_a_forced_mlp_chunk_is_capped_and_checked():
    assert resolve_mlp_chunk_tokens(5, 48, 64, 4) == 5
    assert resolve_mlp_chunk_tokens(4096, 48, 64, 4) == 48
    assert resolve_mlp_chunk_tokens("auto", 48, 64, 4) == 48
    for bad in (0, -3, True, "big", 2.5):
        with pytest.raises(ValueError, match=r"parallel.mlp_chunk_tokens=.* must be 'auto' or an integer >= 1"):
            resolve_mlp_chunk_tokens(bad, 48, 64, 4)


def test_the_vocab_rings_dx_is_fp32_only_where_the_loss_is_not_tiled():
    """TSP's dX of the loss (parallel/tsp/vocab.py): fp32 with one chunk, the activation dtype
    once tiled. Llama-3.1-8B (16,032 rows per rank on 8) at 128K tokens has 16,384 local tokens:
    `auto` takes one chunk there, so the default keeps the fp32 dX; at 7,340,032 tokens (917,504
    local) it tiles, and a bf16 run holds dX in bf16."""
    import torch

    from tsp_trainer.parallel.tsp.vocab import dx_accumulator_dtype

    def dtype_at(local_tokens, dtype):
        chunk = resolve_loss_chunk_tokens("auto", local_tokens, 16_032)
        return dx_accumulator_dtype(dtype, len(token_chunks(local_tokens, chunk)))

    assert dtype_at(16_384, torch.bfloat16) == torch.float32
    assert dtype_at(917_504, torch.bfloat16) == torch.bfloat16
    assert dtype_at(917_504, torch.float32) == torch.float32
