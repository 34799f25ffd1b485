import pytest
import torch

from tsp_trainer.parallel import zigzag


@pytest.mark.parametrize("degree", [1, 2, 4])
def test_positions_cover_sequence_once(degree):
    s = 8 * degree
    pos = torch.cat([zigzag.zigzag_positions(s, r, degree) for r in range(degree)])
    assert sorted(pos.tolist()) == list(range(s))


def test_rank_holds_chunks_p_and_2d_minus_1_minus_p():
    assert zigzag.zigzag_positions(16, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert zigzag.zigzag_positions(16, 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert zigzag.zigzag_positions(16, 0, 4).tolist() == [0, 1, 14, 15]


@pytest.mark.parametrize("degree", [1, 2, 4])
def test_shard_unshard_and_gathered_order(degree):
    x = torch.arange(2 * 8 * degree * 3).view(2, 8 * degree, 3)
    parts = [zigzag.shard_sequence(x, r, degree) for r in range(degree)]
    assert torch.equal(zigzag.unshard_sequence(parts), x)
    gathered = torch.stack(parts)                     # what all_gather produces: [D, B, S/D, 3]
    assert torch.equal(zigzag.gathered_to_logical(gathered), x)
    assert torch.equal(zigzag.logical_to_gathered(x, degree), gathered)


def test_labels_follow_tokens():
    ids = torch.arange(17)[None]
    inp, lab = ids[:, :-1], ids[:, 1:]
    li, ll, pos = zigzag.shard_batch(inp, lab, 1, 2)
    assert torch.equal(ll, li + 1) and torch.equal(li[0], pos.tensor())


def test_seq_len_must_split_into_2d_chunks():
    with pytest.raises(ValueError, match=r"data.seq_len=12 .*2 \* parallel.tsp_degree = 8"):
        zigzag.zigzag_positions(12, 0, 4)


@pytest.mark.parametrize("degree", [1, 2, 4])
def test_pair_to_gathered_is_the_stacked_layout_without_the_stack(degree):
    k = torch.randn(2, 3, 8 * degree, 5).transpose(1, 2)         # [B, S, H, d], strided (as dK is)
    v = torch.randn(2, 8 * degree, 3, 5)
    expected = zigzag.logical_to_gathered(torch.stack((k, v), dim=2), degree)
    got = zigzag.pair_to_gathered(k, v, degree)
    assert got.is_contiguous() and torch.equal(got, expected)
