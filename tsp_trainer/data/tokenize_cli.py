"""`tsp-tokenize SRC OUT --tokenizer TOK`: tokenize a dataset once, for every later run.

Every DP rank of a large job otherwise tokenizes its share of the text at every epoch, and all D
ranks of a TSP group tokenize the same documents. This command tokenizes SRC (a local file, folder
or glob, or a Hub dataset) with `datasets.map(num_proc=N)` into OUT, which `data.source=OUT` then
streams without running the tokenizer:

    OUT/train-00000-of-00008.parquet ...   column "input_ids" (list<int32>), row groups of about
                                           --row-group-tokens tokens (so reshard() can split them)
    OUT/train-00000-of-00008.bin/.idx ...  with --format bin: memory-mapped token files
    OUT/validation-...                     the other splits found in SRC, same layout
    OUT/tokenized.json                     tokenizer (name, vocab size, BOS, EOS), per split: files,
                                           documents, tokens; the loader checks the tokenizer

Documents keep their order and their ids are exactly what the training loader would produce from
the text (the same DocumentTokenizer: empty documents stay, as empty lists; bad UTF-8 is repaired
the same way), so a run on OUT trains on the same batches, token for token. `--shards K` cuts each
split into K files of about equal tokens: use a multiple of the DP degree. OUT is written under a
temporary name and renamed at the end; a failure leaves nothing behind. Exit status 2 with one
line on stderr for bad input.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import typing
from pathlib import Path
from typing import Any

import numpy as np

from tsp_trainer.config.schema import DataFormat
from tsp_trainer.data.pretokenized import write_metadata
from tsp_trainer.data.streaming import (BUILDER_BY_FORMAT, check_column, folder_split_files,
                                        is_single_file_source, load_streaming, resolve_local_files)
from tsp_trainer.data.tokenfile import TOKEN_FIELD, write_token_arrays
from tsp_trainer.data.tokenize import TextTokenizer, load_tokenizer

_TOKENIZERS: dict[str, Any] = {}     # one per worker process of datasets.map
# data.format's values that hold text ("tokens" is already tokenized)
_TEXT_FORMATS = tuple(f for f in typing.get_args(DataFormat) if f != "tokens")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tsp-tokenize", description=(
        "Tokenize a dataset once into files that data.source streams without a tokenizer."))
    p.add_argument("source", help="a local file, folder or glob (jsonl, parquet, arrow, txt), or "
                                  "a Hub dataset name")
    p.add_argument("out", help="output folder (must not exist or be empty, unless --overwrite)")
    p.add_argument("--tokenizer", required=True, help="tokenizer folder, tokenizer.json or Hub name "
                                                      "(the run's data.tokenizer)")
    p.add_argument("--num-proc", type=int, default=1, help="processes for datasets.map (default 1)")
    p.add_argument("--shards", type=int, default=0,
                   help="files per split, of about equal tokens (use a multiple of the DP degree); "
                        "0 (default) = one output file per source file, in order")
    p.add_argument("--format", choices=("parquet", "bin"), default="parquet",
                   help="parquet (a token-id column) or bin (memory-mapped .bin/.idx)")
    p.add_argument("--splits", default=None,
                   help="comma-separated splits (default: all splits of a folder; 'train' for a "
                        "file or glob)")
    p.add_argument("--text-field", default="text", help="column holding the text (default text)")
    p.add_argument("--data-format", default="auto",
                   choices=_TEXT_FORMATS,
                   help="the format of SRC, as data.format (default: from the extensions)")
    p.add_argument("--row-group-tokens", type=int, default=1 << 20,
                   help="parquet row-group size in tokens (default 1Mi)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        meta = tokenize_dataset(args.source, args.out, tokenizer=args.tokenizer,
                                num_proc=args.num_proc, shards=args.shards, fmt=args.format,
                                splits=args.splits.split(",") if args.splits else None,
                                text_field=args.text_field, data_format=args.data_format,
                                row_group_tokens=args.row_group_tokens, overwrite=args.overwrite)
    except ValueError as err:
        print(f"tsp-tokenize: error: {err}", file=sys.stderr)
        return 2
    for split, info in meta["splits"].items():
        print(f"tsp-tokenize: {split}: {info['docs']:,} documents, {info['tokens']:,} tokens in "
              f"{len(info['files'])} file(s)")
    print(f"tsp-tokenize: wrote {args.out}; train with data.source={args.out}")
    return 0


def tokenize_dataset(source: str, out: str | os.PathLike, *, tokenizer: str, num_proc: int = 1,
                     shards: int = 0, fmt: str = "parquet", splits: list[str] | None = None,
                     text_field: str = "text", data_format: str = "auto",
                     row_group_tokens: int = 1 << 20, overwrite: bool = False) -> dict[str, Any]:
    """Tokenize every split of `source` into `out`; returns the metadata written."""
    out = Path(out)
    _check_args(out, num_proc=num_proc, shards=shards, row_group_tokens=row_group_tokens,
                overwrite=overwrite)
    tok = load_tokenizer(tokenizer)
    splits = splits or _splits_of(source, data_format)
    for split in splits:           # missing splits and columns fail here, before any work
        stream = load_streaming(source, split=split, data_format=data_format)
        check_column(stream, text_field, source=source, split=split, key="--text-field")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        meta = {"created_by": "tsp-tokenize", "version": 1, "source": source,
                "text_field": text_field, "format": fmt, "token_field": TOKEN_FIELD,
                "tokenizer": tokenizer, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
                "bos_id": tok.bos_id, "splits": {}}
        for split in splits:
            parts = _tokenized_split(source, split, tokenizer=tokenizer, text_field=text_field,
                                     data_format=data_format, num_proc=num_proc,
                                     cache=tmp / ".cache", per_file=shards == 0)
            meta["splits"][split] = _write_split(parts, tmp, split, shards=shards, fmt=fmt,
                                                 tok=tok, row_group_tokens=row_group_tokens)
        shutil.rmtree(tmp / ".cache", ignore_errors=True)
        write_metadata(tmp, meta)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)          # mkdtemp made it private
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def _check_args(out: Path, *, num_proc: int, shards: int, row_group_tokens: int,
                overwrite: bool) -> None:
    for key, value, low in (("--num-proc", num_proc, 1), ("--shards", shards, 0),
                            ("--row-group-tokens", row_group_tokens, 1)):
        if value < low:
            raise ValueError(f"{key}={value} must be >= {low}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ValueError(f"output {str(out)!r} exists and is not empty; pass --overwrite or "
                         "choose another folder")
    if not out.parent.is_dir():
        raise ValueError(f"the parent folder of {str(out)!r} does not exist")


def _splits_of(source: str, data_format: str) -> list[str]:
    """A folder's splits (train, validation, ...); 'train' for a file, glob or Hub name."""
    path = Path(source).expanduser()
    if data_format == "hub" or is_single_file_source(source, data_format) or not path.is_dir():
        return ["train"]
    from datasets.data_files import DataFilesDict, get_data_patterns

    found = DataFilesDict.from_patterns(get_data_patterns(str(path)), base_path=str(path))
    return sorted(str(s) for s in found if folder_split_files(path, split=str(s)))


def _tokenized_split(source: str, split: str, *, tokenizer: str, text_field: str,
                     data_format: str, num_proc: int, cache: Path, per_file: bool) -> list:
    """The split as map-style Datasets (one per source file when `per_file`, else one) with one
    column of token ids, tokenized with datasets.map(num_proc)."""
    import datasets

    local = resolve_local_files(source, split=split, data_format=data_format)
    if local is None:
        parts = [datasets.load_dataset(source, split=split, cache_dir=str(cache))]
    else:
        fmt, files = local
        if fmt == "tokens":
            raise ValueError(f"{source!r} holds token files already; nothing to tokenize")
        kwargs = {"encoding_errors": "replace"} if fmt == "text" else {}
        groups = [[f] for f in files] if per_file else [files]
        parts = [datasets.load_dataset(BUILDER_BY_FORMAT[fmt], data_files={split: group},
                                       split=split, cache_dir=str(cache), **kwargs)
                 for group in groups]
    out, first_row = [], 0
    for ds in parts:
        if text_field not in ds.column_names:
            raise ValueError(f"dataset {source!r} split {split!r} has no column --text-field="
                             f"{text_field!r}; its columns are {sorted(ds.column_names)}")
        out.append(ds.map(_tokenize_rows, batched=True, batch_size=256, num_proc=num_proc,
                          with_indices=True, remove_columns=ds.column_names,
                          fn_kwargs={"tokenizer": tokenizer, "text_field": text_field,
                                     "source": source, "split": split, "first_row": first_row},
                          desc=f"tokenizing {split}"))
        first_row += len(ds)
    return out


def _tokenize_rows(batch: dict[str, list], indices: list[int], *, tokenizer: str, text_field: str,
                   source: str, split: str, first_row: int = 0) -> dict[str, list]:
    """datasets.map function (module level: it runs in worker processes)."""
    from tsp_trainer.data.documents import DocumentTokenizer

    key = f"{tokenizer}\0{text_field}\0{source}"
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = DocumentTokenizer(load_tokenizer(tokenizer), text_field=text_field,
                                             source=source)
    reader = _TOKENIZERS[key]
    rows = [{text_field: t} for t in batch[text_field]]
    wheres = [f"row {first_row + i} of split {split!r}" for i in indices]
    return {TOKEN_FIELD: [ids for ids, _ in reader.encode_rows(rows, wheres)]}


def _write_split(parts: list, folder: Path, split: str, *, shards: int, fmt: str,
                 tok: TextTokenizer, row_group_tokens: int) -> dict[str, Any]:
    """Write the split: one file per part (shards=0), or the parts re-cut into `shards` files of
    about equal tokens (document order kept either way)."""
    import datasets

    if shards:
        ds = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
        lengths = _lengths(ds)
        cuts = _equal_token_cuts(lengths, min(shards, max(len(lengths), 1)))
        pieces = [ds.select(range(a, b)) for a, b in zip(cuts[:-1], cuts[1:])]
    else:
        pieces = parts
    files, docs, nonempty, tokens = [], 0, 0, 0
    for i, piece in enumerate(pieces):
        lengths = _lengths(piece)
        name = f"{split}-{i:05d}-of-{len(pieces):05d}"
        if fmt == "bin":
            path = folder / f"{name}.bin"
            ids = piece.with_format("arrow")[:][TOKEN_FIELD]
            write_token_arrays(path, np.asarray(_flatten(ids)), lengths, vocab_size=tok.vocab_size)
        else:
            path = folder / f"{name}.parquet"
            _write_parquet(piece, path, lengths, row_group_tokens, tok.vocab_size)
        files.append(path.name)
        docs, nonempty, tokens = docs + len(lengths), nonempty + int((lengths > 0).sum()), \
            tokens + int(lengths.sum())
    return {"files": files, "docs": docs, "nonempty_docs": nonempty, "tokens": tokens}


def _lengths(ds) -> np.ndarray:
    import pyarrow.compute as pc

    column = ds.with_format("arrow")[:][TOKEN_FIELD]
    return np.asarray(pc.list_value_length(column).fill_null(0), dtype=np.int64)


def _flatten(column):
    import pyarrow.compute as pc

    return pc.list_flatten(column)


def _equal_token_cuts(lengths: np.ndarray, parts: int) -> list[int]:
    """Row boundaries cutting `lengths` into `parts` contiguous pieces of about equal tokens,
    each with at least one row."""
    n = len(lengths)
    if n == 0:
        return [0, 0]
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    total = int(lengths.sum())
    cuts = [0]
    for k in range(1, parts):
        at = int(np.searchsorted(starts, k * total / parts, side="left"))
        cuts.append(min(max(at, cuts[-1] + 1), n - (parts - k)))
    return cuts + [n]


def _write_parquet(part, path: Path, lengths: np.ndarray, row_group_tokens: int,
                   vocab_size: int) -> None:
    """One parquet file, list<int32> ids, row groups of about `row_group_tokens` tokens."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    value_type = pa.int32() if vocab_size < 1 << 31 else pa.int64()
    schema = pa.schema([(TOKEN_FIELD, pa.list_(value_type))])
    table = part.with_format("arrow")[:].cast(schema)
    tmp = path.with_name(f".{path.name}.tmp")
    with pq.ParquetWriter(tmp, schema) as writer:
        start, acc = 0, 0
        for i, n in enumerate(lengths):
            acc += int(n)
            if acc >= row_group_tokens or i == len(lengths) - 1:
                writer.write_table(table.slice(start, i + 1 - start), row_group_size=i + 1 - start)
                start, acc = i + 1, 0
        if len(lengths) == 0:
            writer.write_table(table)
    os.replace(tmp, path)


if __name__ == "__main__":
    raise SystemExit(main())
