"""The DP split reads about 1/dp of the bytes per rank: whole files, parquet row
groups after reshard(), token-file ranges; the read-everything fallback is refused at large DP
degrees in one line, and still allowed (with a warning) at small ones. Bytes are measured with
/proc/self/io (every byte the process reads), not inferred from the assignment."""

from __future__ import annotations

import os
import warnings

import pytest

from tests.unit.data_helpers import bytes_read, write_jsonl
from tsp_trainer.data import streaming
from tsp_trainer.data.streaming import load_streaming, open_text_stream

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs /proc/self/io")

FILES, DP, DOCS_PER_FILE = 23, 8, 40


@pytest.fixture(scope="module")
def folder_23(tmp_path_factory):
    """23 jsonl train files of equal size (like PG19's 23 files), 40 documents each."""
    folder = tmp_path_factory.mktemp("pg19_like")
    for f in range(FILES):
        write_jsonl(folder / f"train-{f:05d}-of-{FILES:05d}.jsonl",
                    [f"file {f} doc {i} " + "lorem ipsum " * 150 for i in range(DOCS_PER_FILE)])
    return folder


def _read_rank(source, rank, **kw) -> tuple[list[str], int]:
    before = bytes_read()
    texts = [row["text"] for row in open_text_stream(str(source), dp_rank=rank, dp_degree=DP, **kw)]
    return texts, bytes_read() - before


def test_23_files_over_8_ranks_read_at_most_twice_the_fair_share(folder_23):
    total = sum(p.stat().st_size for p in folder_23.iterdir())
    _read_rank(folder_23, 0)                       # warm up: lazy imports read files too
    seen, shares = [], []
    for rank in range(DP):
        texts, nbytes = _read_rank(folder_23, rank)
        seen += texts
        shares.append(nbytes / (total / DP))
    # Measured: 1.39x on ranks with 3 files (3 of 23 files, plus the json builder's peek at the
    # first file to infer the columns), 1.04x on the rank with 2.
    assert max(shares) <= 2.0, shares
    assert sorted(seen) == sorted(f"file {f} doc {i} " + "lorem ipsum " * 150
                                  for f in range(FILES) for i in range(DOCS_PER_FILE))   # each once


def test_the_example_split_would_read_everything(folder_23):
    """The instrument can tell: datasets' "examples" strategy (its default for 23
    files over 8 ranks) reads the whole dataset on every rank."""
    from datasets.distributed import split_dataset_by_node

    total = sum(p.stat().st_size for p in folder_23.iterdir())
    before = bytes_read()
    rows = list(split_dataset_by_node(load_streaming(str(folder_23), split="train"), rank=3,
                                      world_size=DP, strategy="examples"))
    assert len(rows) == FILES * DOCS_PER_FILE // DP
    assert bytes_read() - before >= 0.9 * total            # 8x the fair share


def test_one_parquet_file_is_split_by_row_group(tmp_path):
    """One parquet file of 23 row groups (0.5 MB each, random letters so compression does not
    shrink the data below the footer reads) over 8 ranks: reshard() makes 23 shards."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz ", dtype=np.uint8)
    rng = np.random.default_rng(0)
    texts = [f"row {i} " + letters[rng.integers(0, 27, 25_000)].tobytes().decode()
             for i in range(23 * 20)]
    path = tmp_path / "one.parquet"
    pq.write_table(pa.table({"text": texts}), path, row_group_size=20)      # 23 row groups
    dataset = load_streaming(str(path), split="train")
    assert dataset.num_shards == 1 and dataset.reshard().num_shards == 23
    _read_rank(path, 0)
    per_rank, shares = [], []
    for rank in range(DP):
        got, nbytes = _read_rank(path, rank)
        per_rank.append(got)
        shares.append(nbytes / (path.stat().st_size / DP))
    assert sorted(sum(per_rank, [])) == sorted(texts)
    assert max(shares) <= 2.0, shares          # measured 1.16x (3 of 23 row groups + footers)


def test_fallback_is_refused_at_large_dp_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(streaming, "SMALL_SOURCE_BYTES", 0)     # as if the file were large
    path = write_jsonl(tmp_path / "big.jsonl", [f"doc {i}" for i in range(300)])
    with pytest.raises(ValueError) as err:
        open_text_stream(str(path), dp_rank=0, dp_degree=128)
    message = str(err.value)
    assert "\n" not in message
    for part in ("1 file(s)/shard(s)", "dp_degree=128", "data.max_example_split_dp=8",
                 "tsp-tokenize", "at least 128 files"):
        assert part in message, part
    # Raising the limit allows it (with the warning), as for small DP degrees by default.
    with pytest.warns(UserWarning, match="every DP rank will stream all of it"):
        rows = list(open_text_stream(str(path), dp_rank=5, dp_degree=128, max_example_split_dp=128))
    assert [r["text"] for r in rows] == ["doc 5", "doc 133", "doc 261"]


def test_uneven_file_count_uses_shards_not_examples(tmp_path):
    """3 files over 2 ranks: 2 + 1 files, never the example split (no warning)."""
    for f in range(3):
        write_jsonl(tmp_path / f"train-{f}.jsonl", [f"f{f} d{i}" for i in range(4)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ranks = [[r["text"] for r in open_text_stream(str(tmp_path / "train-*.jsonl"), dp_rank=k,
                                                      dp_degree=2)] for k in range(2)]
    assert sorted(map(len, ranks)) == [4, 8]
    assert sorted(ranks[0] + ranks[1]) == sorted(f"f{f} d{i}" for f in range(3) for i in range(4))


def test_token_file_ranges_balance_tokens_across_ranks(tmp_path):
    """One token file, 8 ranks: 32 ranges of equal tokens, 4 per rank, whatever the file count."""
    import numpy as np

    from tsp_trainer.data.tokenfile import document_ranges, write_token_file

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 1000, size=int(n)).tolist() for n in rng.integers(1, 400, size=500)]
    write_token_file(tmp_path / "train.bin", docs, vocab_size=1024)
    ranges = document_ranges([str(tmp_path / "train.bin")], 32)
    assert len(ranges) == 32
    per_rank = [0] * DP
    for k, segments in enumerate(ranges):
        per_rank[k % DP] += sum(sum(len(docs[d]) for d in range(a, b)) for _, a, b in segments)
    total = sum(map(len, docs))
    assert max(per_rank) <= 1.1 * total / DP
    got = sum(([list(map(int, r["input_ids"])) for r in
                open_text_stream(str(tmp_path / "train.bin"), text_field="input_ids",
                                 dp_rank=k, dp_degree=DP)] for k in range(DP)), [])
    assert sorted(map(tuple, got)) == sorted(map(tuple, docs))
