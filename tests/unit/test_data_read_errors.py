"""Bad jsonl lines are named by file, line and byte offset: when the loader reaches them (pyarrow's
own error names neither, and counts rows within a block), and at start-up for the head and the tail
of every file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit.data_helpers import TOKENIZER, tiny_config
from tsp_trainer.data import check_data_config, load_tokenizer
from tsp_trainer.data.loader import open_documents
from tsp_trainer.data.read_errors import DataError, check_jsonl_ends, first_bad_line

GOOD = [json.dumps({"text": f"document {i} " + "word " * (i % 7)}).encode() + b"\n"
        for i in range(3000)]
BAD = {"invalid JSON": (b'{"text": "cut off\n', "not valid JSON (Unterminated string"),
       "latin-1": ('{"text": "caf\xe9"}\n'.encode("latin-1"), "byte 13 of the line (0xe9) is not UTF-8"),
       "binary garbage": (b"\x00\x9c\xff\xfe\x01garbage\n", "byte 1 of the line (0x9c) is not UTF-8"),
       "not an object": (b'["text", 1]\n', "a JSON list, not an object")}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TOKENIZER)


def _write(path: Path, bad_line: bytes, at: int, lines=GOOD) -> tuple[Path, int]:
    """`lines` with `bad_line` as line `at` (1-based); returns the path and the line's byte offset."""
    content = list(lines)
    content.insert(at - 1, bad_line)
    path.write_bytes(b"".join(content))
    return path, sum(len(line) for line in content[:at - 1])


def _read_all(path: str, tok) -> None:
    docs = open_documents(path, tokenizer=tok)
    for _ in range(len(GOOD) + 2):
        docs.next_document()


@pytest.mark.parametrize("kind", sorted(BAD))
def test_a_bad_line_deep_in_the_file_is_named_by_file_line_and_offset(tmp_path, tok, kind):
    bad, reason = BAD[kind]
    path, offset = _write(tmp_path / "train.jsonl", bad, at=2345)
    with pytest.raises(DataError) as info:
        _read_all(str(path), tok)
    assert str(info.value) == (f"data file {path} line 2345 (byte offset {offset}): "
                               + str(info.value).split(f"(byte offset {offset}): ", 1)[1])
    assert reason in str(info.value) and "expected one JSON object per line" in str(info.value)
    assert "\n" not in str(info.value)


def test_the_bad_file_of_several_is_named(tmp_path, tok):
    (tmp_path / "data").mkdir()
    _write(tmp_path / "data" / "train-00000-of-00002.jsonl", GOOD[0], at=1, lines=GOOD[:500])
    bad, _ = _write(tmp_path / "data" / "train-00001-of-00002.jsonl", b"{oops}\n", at=120,
                    lines=GOOD[:500])
    with pytest.raises(DataError, match=f"data file {bad} line 120 "):
        docs = open_documents(str(tmp_path / "data"), tokenizer=tok)
        for _ in range(1100):
            docs.next_document()


def test_file_ends_are_checked_and_the_middle_is_left_to_the_reader(tmp_path):
    sample = 4096
    tail, offset = _write(tmp_path / "tail.jsonl", b'{"text": 1,}\n', at=len(GOOD) + 1)
    with pytest.raises(DataError) as info:
        check_jsonl_ends([str(tail)], sample_bytes=sample)
    assert f"data file {tail} line {len(GOOD) + 1} (byte offset {offset}): not valid JSON" in str(info.value)
    head, _ = _write(tmp_path / "head.jsonl", b"\xff\n", at=3)
    with pytest.raises(DataError, match=f"data file {head} line 3 "):
        check_jsonl_ends([str(head)], sample_bytes=sample)
    middle, offset = _write(tmp_path / "middle.jsonl", b"{oops}\n", at=1500)
    check_jsonl_ends([str(middle)], sample_bytes=sample)         # beyond both samples
    assert first_bad_line(str(middle)).startswith(f"data file {middle} line 1500 (byte offset {offset})")
    no_newline = tmp_path / "last.jsonl"
    no_newline.write_bytes(b"".join(GOOD) + b'{"text": "no end')  # a cut last line, no newline
    with pytest.raises(DataError, match=f"line {len(GOOD) + 1} "):
        check_jsonl_ends([str(no_newline)], sample_bytes=sample)
    array = tmp_path / "array.json"
    array.write_text(json.dumps([{"text": "a"}, {"text": "b"}], indent=1))
    check_jsonl_ends([str(array)], sample_bytes=sample)          # one JSON array: not lines


def test_start_up_check_refuses_a_bad_last_line(tmp_path, tok):
    path, _ = _write(tmp_path / "train.jsonl", b'{"text": "latin \xe9"}\n', at=len(GOOD) + 1)
    with pytest.raises(DataError) as info:
        check_data_config(tiny_config([f"data.source={path}"]), 1, tokenizer=tok)
    assert str(info.value).startswith(f"data file {path} line {len(GOOD) + 1} (byte offset ")
    assert "is not UTF-8" in str(info.value)
