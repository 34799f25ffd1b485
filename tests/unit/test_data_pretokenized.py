"""Pre-tokenized data: `tsp-tokenize` on the bundled corpus, training from its
output reproducing the text path's batches token for token, token files and token-id columns
read without a tokenizer, exact resume on both, and clear errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.unit.data_helpers import CORPUS, TOKENIZER, assert_same_batches, take, write_jsonl
from tsp_trainer.data import build_loader, load_tokenizer
from tsp_trainer.data.tokenize_cli import main as tokenize_main


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory):
    """The bundled corpus tokenized once: parquet (2 processes, one file per source file) and
    memory-mapped token files cut into 3 files of equal tokens."""
    root = tmp_path_factory.mktemp("tokenized")
    assert tokenize_main([str(CORPUS), str(root / "pq"), "--tokenizer", str(TOKENIZER),
                          "--num-proc", "2"]) == 0
    assert tokenize_main([str(CORPUS), str(root / "bin"), "--tokenizer", str(TOKENIZER),
                          "--format", "bin", "--shards", "3"]) == 0
    return root


def _texts(path):
    return [json.loads(line)["text"] for line in path.read_text().splitlines()]


def test_tokenize_command_on_the_bundled_corpus(tokenized, tok):
    import pyarrow.parquet as pq

    meta = json.loads((tokenized / "pq" / "tokenized.json").read_text())
    assert (meta["vocab_size"], meta["eos_id"], meta["bos_id"]) == (1024, 0, None)
    # data/README.md: 342,285 + 356,882 train tokens, 36,609 validation tokens.
    assert meta["splits"]["train"]["tokens"] == 342_285 + 356_882
    assert meta["splits"]["validation"]["tokens"] == 36_609
    assert meta["splits"]["train"]["files"] == ["train-00000-of-00002.parquet",
                                                "train-00001-of-00002.parquet"]
    shard = pq.read_table(tokenized / "pq" / "train-00001-of-00002.parquet")
    expected = [tok.encode(t) for t in _texts(CORPUS / "train-00001-of-00002.jsonl")]
    assert shard.column("input_ids").to_pylist() == expected         # order and ids kept
    assert shard.num_rows > 1 and pq.ParquetFile(
        tokenized / "pq" / "train-00001-of-00002.parquet").num_row_groups >= 1
    bins = json.loads((tokenized / "bin" / "tokenized.json").read_text())
    assert len(bins["splits"]["train"]["files"]) == 3
    assert bins["splits"]["train"]["tokens"] == meta["splits"]["train"]["tokens"]
    assert not [p for p in tokenized.iterdir() if p.name.startswith(".")]    # no temporaries


@pytest.mark.parametrize("fmt,dp", [("pq", 1), ("pq", 2), ("bin", 1)])
@pytest.mark.parametrize("shuffle", [False, True])
def test_training_from_tokenized_output_reproduces_the_text_batches(tokenized, tok, fmt, dp,
                                                                    shuffle):
    """Token for token, on every DP rank. (Token files cut by --shards balance the ranks by
    tokens instead of following the source files, so with dp > 1 they assign other documents.)"""
    for rank in range(dp):
        kw = dict(tokenizer=tok, seq_len=128, micro_batch_size=4, dp_rank=rank, dp_degree=dp,
                  shuffle=shuffle, shuffle_buffer=16, seed=3)
        text = build_loader(str(CORPUS), **kw)
        tokens = build_loader(str(tokenized / fmt), **kw)
        assert_same_batches(take(tokens, 60), take(text, 60))


@pytest.mark.parametrize("fmt", ["pq", "bin"])
def test_resume_is_exact_on_tokenized_data(tokenized, tok, fmt):
    kw = dict(tokenizer=tok, seq_len=64, micro_batch_size=2, dp_rank=1, dp_degree=2, shuffle=True,
              shuffle_buffer=8, seed=1)
    reference = take(build_loader(str(tokenized / fmt), **kw), 30)
    got, state = [], None
    for _ in range(3):
        loader = build_loader(str(tokenized / fmt), **kw)
        if state is not None:
            loader.load_state_dict(state)
        got += take(loader, 10)
        state = json.loads(json.dumps(loader.state_dict()))
        loader.close()
    assert_same_batches(got, reference)


def test_token_column_of_any_parquet_and_its_range_check(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [[5, 6, 7], [], [8, 9], [10, 11, 12, 13]]
    pq.write_table(pa.table({"ids": docs}), tmp_path / "ids.parquet")
    loader = build_loader(str(tmp_path / "ids.parquet"), tokenizer=tok, seq_len=4,
                          micro_batch_size=1, token_field="ids")
    stream = [int(x) for b in take(loader, 3) for x in b["input_ids"][0]]
    assert stream == [5, 6, 7, 0, 8, 9, 0, 10, 11, 12, 13, 0]     # EOS after each, empty skipped
    assert loader.stats["docs_empty"] == 1
    pq.write_table(pa.table({"ids": [[1, 2], [3, 5000]]}), tmp_path / "bad.parquet")
    bad = build_loader(str(tmp_path / "bad.parquet"), tokenizer=tok, seq_len=8,
                       micro_batch_size=1, token_field="ids")
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 1024\)"):
        next(bad)
    # The same column in an Arrow IPC file.
    with pa.OSFile(str(tmp_path / "ids.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, pa.schema([("ids", pa.list_(pa.int32()))])) as writer:
            writer.write_table(pa.table({"ids": docs}, schema=pa.schema([("ids", pa.list_(pa.int32()))])))
    arrow = build_loader(str(tmp_path / "ids.arrow"), tokenizer=tok, seq_len=4,
                         micro_batch_size=1, token_field="ids")
    assert [int(x) for b in take(arrow, 3) for x in b["input_ids"][0]] == stream


def test_tokenized_output_refuses_another_tokenizer(tokenized, tok, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tokenized / "bin", copy)
    meta = json.loads((copy / "tokenized.json").read_text())
    meta["vocab_size"] = 32000
    (copy / "tokenized.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"was tokenized by .*\(vocab_size, eos_id, bos_id\)="
                                         r"\(32000, 0, None\).*re-run tsp-tokenize"):
        build_loader(str(copy), tokenizer=tok, seq_len=8, micro_batch_size=1)


def test_tokenize_command_errors_are_one_line_and_leave_nothing(tmp_path, capsys, tokenized):
    src = write_jsonl(tmp_path / "d.jsonl", ["a", "b"], field="content")
    out = tmp_path / "out"
    assert tokenize_main([str(src), str(out), "--tokenizer", str(TOKENIZER)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no column --text-field='text'" in err and "content" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl"]         # nothing half-written
    assert tokenize_main([str(CORPUS), str(tokenized / "pq"), "--tokenizer", str(TOKENIZER)]) == 2
    assert "exists and is not empty; pass --overwrite" in capsys.readouterr().err


def test_token_file_round_trip(tmp_path):
    from tsp_trainer.data.tokenfile import TokenFile, write_token_file

    docs = [[1, 2, 3], [], [70000, 4]]
    write_token_file(tmp_path / "t.bin", docs, vocab_size=100000)        # uint32 past 65,536
    tf = TokenFile(tmp_path / "t.bin")
    assert tf.tokens.dtype == np.dtype("<u4") and tf.num_docs == 3 and tf.num_tokens == 5
    assert [tf.doc(d).tolist() for d in range(3)] == docs
    (tmp_path / "t.bin").write_bytes(b"\x00" * 7)
    with pytest.raises(ValueError, match="does not match its index"):
        TokenFile(tmp_path / "t.bin")
