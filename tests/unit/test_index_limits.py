"""Index and offset arithmetic at N = 16M tokens (2^24), world 8: positions, zigzag runs, RoPE
tables, document plans, varlen offsets and document ids. Tensors are fake (FakeTensorMode) where
the values are not needed; `LargestAllocation` records the largest tensor any op creates, so a
table of N^2 or N x max_seq_len elements, or a dense mask, would fail the test."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tsp_trainer.config.model import FP32_EXACT_POSITIONS, RopeScaling
from tsp_trainer.data.packing import document_ids
from tsp_trainer.model.documents import (FEW_SEGMENTS, INT32_OFFSET_LIMIT, Documents,
                                         device_offsets, plan_segments, rope_positions, varlen_plan)
from tsp_trainer.model.rope import PositionRuns, Rotary
from tsp_trainer.parallel.zigzag import zigzag_runs

REPO = Path(__file__).resolve().parents[2]
N = 1 << 24           # 16,777,216 tokens in the sequence
WORLD = 8             # TSP degree
LOCAL = N // WORLD    # tokens per rank: two zigzag chunks of N / 16
HEAD_DIM = 128
LLAMA3 = RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=8192)


class LargestAllocation(TorchDispatchMode):
    """The most elements of any tensor an op returns inside the mode (and which op)."""

    def __init__(self):
        super().__init__()
        self.numel, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.op = t.numel(), str(func)
        return out


def fake_then_record():
    """(fake mode, recorder): enter both, the recorder innermost so it sees fake tensors' sizes."""
    return FakeTensorMode(), LargestAllocation()


def document_lengths(total: int, mean: int, seed: int = 0) -> list[int]:
    """Random document lengths (1 .. 2 * mean) summing to `total`."""
    rng, out, left = random.Random(seed), [], total
    while left:
        n = min(left, rng.randint(1, 2 * mean))
        out.append(n)
        left -= n
    return out


def test_zigzag_runs_at_16m_tokens_cover_each_position_once():
    chunk = N // (2 * WORLD)
    seen = []
    for rank in range(WORLD):
        runs = zigzag_runs(N, rank, WORLD)
        assert runs.runs == ((rank * chunk, chunk), ((2 * WORLD - 1 - rank) * chunk, chunk))
        assert len(runs) == LOCAL
        seen.extend(runs.runs)
    assert sorted(seen)[-1] == (N - chunk, chunk)
    assert sum(n for _, n in seen) == N


@pytest.mark.parametrize("scaling", [None, LLAMA3])
def test_rope_tables_at_16m_hold_only_the_ranks_positions(scaling):
    runs = zigzag_runs(N, 0, WORLD)                 # chunks 0 and 2D-1: ends at position N - 1
    fake, largest = fake_then_record()
    with fake, largest:
        rope = Rotary.build(runs, HEAD_DIM, 500000.0, scaling)
    assert rope.positions.dtype == torch.int64 and rope.positions.shape == (LOCAL,)
    assert rope.cos.shape == rope.sin.shape == (LOCAL, HEAD_DIM)
    assert rope.cos.dtype == torch.float32
    # the largest tensor is one table (or the [T, d] angles before cos/sin): the rank's T x d
    assert largest.numel == LOCAL * HEAD_DIM, largest.op
    assert rope.runs[-1] == (LOCAL // 2, LOCAL, N - N // (2 * WORLD))


def test_rope_positions_are_exact_in_fp32_up_to_2_pow_24():
    assert FP32_EXACT_POSITIONS == 1 << 24
    last = torch.tensor([N - 1, N - 2], dtype=torch.int64)
    assert last.to(torch.float32).to(torch.int64).tolist() == [N - 1, N - 2]
    assert torch.tensor([N + 1]).to(torch.float32).item() != N + 1    # why the limit exists
    with pytest.raises(ValueError, match=r"RoPE position 16777216 is not exact in fp32"):
        Rotary.build(PositionRuns.contiguous(2, first=N - 1), HEAD_DIM, 500000.0)


def test_reset_positions_at_16m_restart_per_document_without_a_row_sized_table():
    lengths = document_lengths(N, mean=64 * 1024, seed=1)
    docs = Documents.from_lengths([lengths], reset_positions=True)
    runs = zigzag_runs(N, 3, WORLD)
    fake, largest = fake_then_record()
    with fake, largest:
        positions = rope_positions(runs.runs, docs)
    assert positions.shape == (1, LOCAL) and positions.dtype == torch.int64
    assert largest.numel == LOCAL, largest.op
    # the same values on real tensors, checked at the run boundaries
    real = rope_positions(runs.runs, docs)[0]
    starts = docs.starts[0]
    for index, position in ((0, runs.runs[0][0]), (LOCAL - 1, runs.runs[1][0] + LOCAL // 2 - 1)):
        doc_start = max(s for s in starts if s <= position)
        assert int(real[index]) == position - doc_start


@pytest.mark.parametrize("mean_doc", [N, 8192, 1024])
def test_varlen_offsets_at_16m_are_int32_and_exact(mean_doc):
    lengths = document_lengths(N, mean=mean_doc, seed=2)
    docs = Documents.from_lengths([lengths])
    rank = WORLD - 1
    row = docs.plan(_query_runs(rank))[0]
    plan = varlen_plan(row.segments)
    assert plan.cu_q[-1] == LOCAL                 # every query once
    # each segment's keys: its document's causal prefix; they add up below 2^31
    expected_keys = sum(s.k_stop - s.k_start for s in row.segments)
    assert plan.cu_k[-1] == expected_keys < INT32_OFFSET_LIMIT
    assert plan.max_k <= N and plan.max_q <= LOCAL // 2
    cpu = torch.device("cpu")
    cu_q, cu_k = device_offsets(plan.cu_q, cpu), device_offsets(plan.cu_k, cpu)
    assert cu_q.dtype == cu_k.dtype == torch.int32
    assert int(cu_q[-1]) == LOCAL and int(cu_k[-1]) == expected_keys
    fake, largest = fake_then_record()
    with fake, largest:
        index = plan.key_index()
    assert index.dtype == torch.int64 and index.shape == (expected_keys,)
    assert largest.numel == expected_keys, largest.op    # no N x N or N x S tensor


def _query_runs(rank: int) -> tuple[tuple[int, int, int], ...]:
    return zigzag_runs(N, rank, WORLD).with_documents(None).query_runs()


def test_one_document_at_16m_gathers_each_ranks_causal_prefix():
    # without boundaries rank p's chunks see keys 0..(p+1)C and 0..(2D-p)C: (2D + 1) C in all
    chunk = N // (2 * WORLD)
    for rank in (0, WORLD - 1):
        segments = plan_segments(_query_runs(rank), (0,))
        assert [(s.k_start, s.k_stop) for s in segments] == [(0, (rank + 1) * chunk),
                                                             (0, (2 * WORLD - rank) * chunk)]
        assert varlen_plan(segments).cu_k[-1] == (2 * WORLD + 1) * chunk


def test_offsets_past_int32_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"varlen offset 2147483648 .* int32 .* 2\^31"):
        device_offsets((0, 1 << 30, 1 << 31), torch.device("cpu"))


def test_document_ids_at_16m_are_int32_and_count_eos():
    eos = 0
    ids = torch.ones(1, N, dtype=torch.int64)
    boundaries = [1000, N // 2, N - 2]                       # EOS positions
    ids[0, boundaries] = eos
    doc = document_ids(ids, eos)
    assert doc.dtype == torch.int32 and doc.shape == (1, N)
    assert doc[0, [0, 1000, 1001, N // 2 + 1, N - 1]].tolist() == [0, 0, 1, 2, 3]
    docs = Documents.from_ids(doc)
    assert docs.starts == ((0, 1001, N // 2 + 1, N - 1),)
    fake, largest = fake_then_record()
    with fake:
        fake_ids = torch.empty(1, N, dtype=torch.int64)
        with largest:
            fake_doc = document_ids(fake_ids, eos)
    assert fake_doc.dtype == torch.int32
    assert largest.numel == N, largest.op                    # one [1, N] tensor at a time


def test_key_index_of_many_segments_equals_one_arange_per_segment():
    lengths = document_lengths(4096, mean=20, seed=3)
    row = Documents.from_lengths([lengths]).plan(zigzag_runs(4096, 1, 4).query_runs())[0]
    plan = varlen_plan(row.segments)
    assert len(plan.key_ranges) > FEW_SEGMENTS
    expected = [k for a, b in plan.key_ranges for k in range(a, b)]
    index = plan.key_index()
    assert index.dtype == torch.int64 and index.tolist() == expected


def test_longest_recipe_fits_the_index_limits():
    from tsp_trainer.config import load_config, validate_config

    cfg = load_config(REPO / "recipes" / "llama3_8b_longest.yaml")
    validate_config(cfg, world_size=WORLD)
    seq, degree = cfg.data.seq_len, cfg.parallel.tsp_degree
    assert (seq, degree, cfg.train.global_batch_size) == (7 << 20, WORLD, 1)
    assert cfg.data.document_masking and cfg.train.dtype == "bf16"
    assert seq % (2 * degree) == 0 and seq <= cfg.model.max_seq_len < FP32_EXACT_POSITIONS
    # the most keys a rank gathers (one document over the whole row) stay within int32 offsets
    keys = varlen_plan(plan_segments(zigzag_runs(seq, 0, degree).query_runs())).cu_k[-1]
    assert keys == (2 * degree + 1) * (seq // (2 * degree)) < INT32_OFFSET_LIMIT


def test_a_sequence_past_2_pow_24_is_refused_at_config_time_unless_positions_restart():
    from tsp_trainer.config import load_config, validate_config

    longer = ["data.seq_len=33554432", "model.max_seq_len=33554432"]
    cfg = load_config(REPO / "recipes" / "llama3_8b_longest.yaml", longer)
    with pytest.raises(ValueError, match=r"^data.seq_len=33554432 exceeds 2\^24 = 16777216: RoPE "):
        validate_config(cfg, world_size=WORLD)
    restart = load_config(REPO / "recipes" / "llama3_8b_longest.yaml",
                          [*longer, "data.reset_positions=true"])
    validate_config(restart, world_size=WORLD)
