"""Bad data named by file and line: the DataError every read failure becomes, and the scans that
find the line.

datasets reads jsonl through pyarrow's JSON reader, whose errors name neither the file nor the line
("JSON parse error: Invalid encoding in string. in row 2", the row counted within a block of the
file, or a bare UnicodeDecodeError). On such an error the source's files are re-scanned line by line
for the first line that is not one UTF-8 JSON object: a scan is one read of a file, cheap next to a
failed run. The start-up check (data/checks.py) scans the head and the tail of every jsonl file
(`check_jsonl_ends`), so a bad first or last line is refused before any process group exists.

    try: rows = list(islice(dataset_iter, n))
    except Exception as err: raise read_error(err, files=files, describe=...)   # a DataError

A DataError found during training stops every rank at the next step (run/preemption.py) with
exit 2. Standard library only.
"""

from __future__ import annotations

import json
import os
from types import TracebackType

# jsonl, json: the formats whose lines are scanned (datasets reads both as line-delimited JSON)
LINE_FORMATS = ("jsonl",)
_CHUNK = 1 << 20


class DataError(ValueError):
    """The training data cannot be read at a place the message names (file and line, or the
    document of the stream); the run stops with exit 2. `agreed` is set once every rank knows
    (run/preemption.py), so the CLI prints it once."""

    agreed = False


def bad_line_reason(line: bytes) -> str | None:
    """Why one line of a jsonl file is not a JSON object; None if it is (or is blank)."""
    if not line.strip():
        return None
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as err:
        return (f"byte {err.start} of the line (0x{line[err.start]:02x}) is not UTF-8; re-encode "
                "the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        return f"not valid JSON ({err.msg}, column {err.colno})"
    if not isinstance(value, dict):
        return f"a JSON {type(value).__name__}, not an object"
    return None


def _describe_bad_line(path: str, line_no: int, offset: int, reason: str) -> str:
    return (f"data file {path} line {line_no} (byte offset {offset}): {reason}; expected one JSON "
            "object per line (jsonl)")


def is_json_array_file(path: str) -> bool:
    """A .json file holding one JSON array (not lines): not scanned line by line."""
    with open(path, "rb") as f:
        return f.read(4096).lstrip()[:1] == b"["


def first_bad_line(path: str, *, start: int = 0, end: int | None = None,
                   first_line: int = 1) -> str | None:
    """The message for the first bad line of `path` among the whole lines in bytes [start, end)
    (a line cut by `end` is not judged); `first_line` is the line number at `start`."""
    line_no, offset = first_line, start
    with open(path, "rb") as f:
        f.seek(start)
        pending = b""
        while True:
            budget = _CHUNK if end is None else min(_CHUNK, end - f.tell())
            block = f.read(budget) if budget > 0 else b""
            if not block:
                last = pending if end is None or end >= os.path.getsize(path) else b""
                reason = bad_line_reason(last) if last else None
                return _describe_bad_line(path, line_no, offset, reason) if reason else None
            lines = (pending + block).split(b"\n")
            pending = lines.pop()
            for line in lines:
                reason = bad_line_reason(line)
                if reason:
                    return _describe_bad_line(path, line_no, offset, reason)
                line_no += 1
                offset += len(line) + 1


def line_number_at(path: str, offset: int) -> int:
    """The 1-based number of the line that starts at byte `offset` (newlines before it + 1)."""
    count, done = 0, 0
    with open(path, "rb") as f:
        while done < offset:
            block = f.read(min(_CHUNK, offset - done))
            if not block:
                break
            count += block.count(b"\n")
            done += len(block)
    return count + 1


def check_jsonl_ends(files: list[str], *, sample_bytes: int) -> None:
    """Raise DataError for a bad line among the first and the last `sample_bytes` of each file (the
    whole file when it is smaller than both): a bad head fails the first step, a bad tail the end of
    every epoch."""
    for path in files:
        size = os.path.getsize(path)
        if size == 0 or is_json_array_file(path):
            continue
        if size <= 2 * sample_bytes:
            problem = first_bad_line(path)
        else:
            problem = first_bad_line(path, end=sample_bytes) or _bad_tail(path, size, sample_bytes)
        if problem:
            raise DataError(problem)


def _bad_tail(path: str, size: int, sample_bytes: int) -> str | None:
    with open(path, "rb") as f:
        f.seek(size - sample_bytes)
        cut = f.read(sample_bytes).find(b"\n")      # the first whole line after the cut one
    if cut < 0:
        return None
    start = size - sample_bytes + cut + 1
    return first_bad_line(path, start=start, first_line=line_number_at(path, start))


def read_error(err: BaseException, *, files: list[str], data_format: str, describe: str,
               near: str) -> DataError:
    """A DataError for `err`, raised while reading `describe`'s rows: the first bad line of its
    files when they are jsonl (the file the reader was in first), else `err` with `near`."""
    if data_format in LINE_FORMATS:
        for path in _reading_first(files, err.__traceback__):
            if not is_json_array_file(path) and (problem := first_bad_line(path)):
                return DataError(problem)
    return DataError(f"reading {describe} failed {near}: {type(err).__name__}: {err}"
                     + (f" (files: {_show_files(files)})" if files else ""))


def _reading_first(files: list[str], tb: TracebackType | None) -> list[str]:
    """`files`, the one(s) a reader frame of the traceback had open first (datasets' builders
    keep the path in a local named `file`)."""
    open_now = []
    while tb is not None:
        name = tb.tb_frame.f_locals.get("file")
        if isinstance(name, str):
            open_now.append(os.path.realpath(name))
        tb = tb.tb_next
    return sorted(files, key=lambda f: os.path.realpath(f) not in open_now)


def _show_files(files: list[str], limit: int = 3) -> str:
    shown = ", ".join(files[:limit])
    return shown + (f", ... ({len(files)} files)" if len(files) > limit else "")
