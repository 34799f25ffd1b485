"""Pre-tokenized data: which column holds token ids, and the metadata tsp-tokenize writes.

Three ways in, all read without running a tokenizer (the configured one still gives BOS, EOS and
the vocabulary the ids must fit):
  - `data.token_field=<column>` on any jsonl/parquet/arrow source whose column holds lists of ids;
  - token files (`.bin` + `.idx`, tokenfile.py): the column is "input_ids";
  - a folder written by `tsp-tokenize`: its `tokenized.json` names the column and the tokenizer
    that produced the ids, which must agree with data.tokenizer (vocabulary size, BOS and EOS).
Imports our streaming/tokenfile helpers and the standard library only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tsp_trainer.data.streaming import resolve_local_files
from tsp_trainer.data.tokenfile import TOKEN_FIELD
from tsp_trainer.data.tokenize import TextTokenizer

METADATA_FILE = "tokenized.json"


def read_metadata(source: str) -> dict[str, Any] | None:
    """The tokenized.json of a tsp-tokenize output folder (None for anything else)."""
    path = Path(source).expanduser() / METADATA_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def write_metadata(folder: str | os.PathLike, meta: dict[str, Any]) -> None:
    path = Path(folder) / METADATA_FILE
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def resolve_token_field(source: str, *, token_field: str | None, data_format: str, split: str,
                        tokenizer: TextTokenizer) -> str | None:
    """The column of token ids to read, or None when the source holds text."""
    meta = read_metadata(source) if data_format != "hub" else None
    if meta is not None:
        check_tokenizer_matches(meta, tokenizer, source=source)
        return token_field or meta["token_field"]
    if token_field is not None:
        return token_field
    local = resolve_local_files(source, split=split, data_format=data_format)
    if local is not None and local[0] == "tokens":
        return TOKEN_FIELD
    return None


def check_tokenizer_matches(meta: dict[str, Any], tokenizer: TextTokenizer, *, source: str) -> None:
    """Ids written by one tokenizer mean nothing under another: refuse a mismatch in one line."""
    wrote = (meta.get("vocab_size"), meta.get("eos_id"), meta.get("bos_id"))
    here = (tokenizer.vocab_size, tokenizer.eos_id, tokenizer.bos_id)
    if wrote != here:
        raise ValueError(f"data source {source!r} was tokenized by {meta.get('tokenizer')!r} "
                         f"(vocab_size, eos_id, bos_id)={wrote}, but data.tokenizer="
                         f"{tokenizer.name!r} has {here}; use the same tokenizer or re-run "
                         "tsp-tokenize")
