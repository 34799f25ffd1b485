"""Memory-mapped token files: documents of token ids read without a tokenizer.

One shard is two files (the format `tsp-tokenize --format bin` writes):

    NAME.bin   every document's token ids back to back, little-endian uint16 (vocabularies up to
               65,536) or uint32; no separators (the packer adds BOS/EOS as the tokenizer wants)
    NAME.idx   numpy .npy, int64 [num_docs + 1]: document d is tokens[idx[d]:idx[d + 1]]

`open_token_files` turns a list of .bin files into a streaming `datasets.IterableDataset` whose
rows are {"input_ids": array view}, so the loader's DP split, epochs and exact resume work as for
any other format. Its shards are ranges of documents with equal token counts, cut across files,
so any number of DP ranks gets an even share of the bytes even from one file. Resuming skips
documents by index: nothing is read but the index. Imports numpy and datasets (lazily).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

import numpy as np

if TYPE_CHECKING:
    from datasets import IterableDataset

TOKEN_FIELD = "input_ids"


def index_path(bin_path: str | os.PathLike) -> Path:
    return Path(bin_path).with_suffix(".idx")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def write_token_file(bin_path: str | os.PathLike, docs: Iterable[Iterable[int]], *,
                     vocab_size: int) -> tuple[int, int]:
    """Write documents (lists of ids) to bin_path and its .idx; returns (documents, tokens).
    Both files are written under temporary names and renamed, so a reader never sees half."""
    bin_path = Path(bin_path)
    dtype = token_dtype(vocab_size)
    offsets = [0]
    tmp_bin = bin_path.with_name(f".{bin_path.name}.tmp")
    with open(tmp_bin, "wb") as f:
        for ids in docs:
            arr = np.asarray(ids, dtype=np.int64)
            if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
                raise ValueError(f"token id {int(arr.max())} out of range for vocab_size="
                                 f"{vocab_size} while writing {bin_path}")
            f.write(arr.astype(dtype).astype(dtype.newbyteorder("<")).tobytes())
            offsets.append(offsets[-1] + int(arr.size))
    tmp_idx = bin_path.with_name(f".{bin_path.stem}.idx.tmp")
    with open(tmp_idx, "wb") as f:
        np.save(f, np.asarray(offsets, dtype=np.int64))
    os.replace(tmp_idx, index_path(bin_path))
    os.replace(tmp_bin, bin_path)
    return len(offsets) - 1, offsets[-1]


def write_token_arrays(bin_path: str | os.PathLike, values: np.ndarray, lengths: np.ndarray, *,
                       vocab_size: int) -> tuple[int, int]:
    """Write documents given as all their ids back to back (`values`) and each one's length."""
    lengths = np.asarray(lengths, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return write_token_file(bin_path, (values[a:b] for a, b in zip(offsets[:-1], offsets[1:])),
                            vocab_size=vocab_size)


class TokenFile:
    """One .bin/.idx pair, memory-mapped (nothing is read until a document is sliced)."""

    def __init__(self, bin_path: str | os.PathLike):
        self.path = str(bin_path)
        idx = index_path(bin_path)
        if not idx.is_file():
            raise ValueError(f"token file {self.path!r} has no index {str(idx)!r} (written by "
                             "tsp-tokenize --format bin next to each .bin)")
        self.offsets = np.load(idx, mmap_mode="r")
        num_tokens = int(self.offsets[-1]) if len(self.offsets) else 0
        size = os.path.getsize(self.path)
        if len(self.offsets) < 1 or (num_tokens and size % num_tokens) or \
                (num_tokens and size // num_tokens not in (2, 4)) or (not num_tokens and size):
            raise ValueError(f"token file {self.path!r} ({size} bytes) does not match its index "
                             f"({num_tokens} tokens): expected 2 or 4 bytes per token")
        dtype = np.dtype("<u2") if not num_tokens or size // num_tokens == 2 else np.dtype("<u4")
        self.tokens = np.memmap(self.path, dtype=dtype, mode="r") if num_tokens else \
            np.zeros(0, dtype=dtype)

    @property
    def num_docs(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def doc(self, d: int) -> np.ndarray:
        return self.tokens[int(self.offsets[d]):int(self.offsets[d + 1])]


def count_tokens(files: list[str]) -> tuple[int, int]:
    """(documents, tokens) in token files, from their indexes only."""
    tfs = [TokenFile(f) for f in files]
    return sum(t.num_docs for t in tfs), sum(t.num_tokens for t in tfs)


def document_ranges(files: list[str], num_ranges: int) -> list[list[tuple[str, int, int]]]:
    """Cut the documents of `files` (in order) into up to `num_ranges` contiguous ranges of about
    equal tokens; a range is a list of (file, first_doc, end_doc) segments. Every range holds at
    least one document, so a dataset with fewer documents gives fewer ranges."""
    tfs = [TokenFile(f) for f in files]
    total_docs = sum(t.num_docs for t in tfs)
    num_ranges = max(1, min(num_ranges, total_docs))
    file_first = np.cumsum([0] + [t.num_docs for t in tfs])         # global index of each file's doc 0
    token_base = np.cumsum([0] + [t.num_tokens for t in tfs])       # global token offset of each file
    total_tokens = int(token_base[-1])

    def first_doc_at(tokens: float) -> int:
        """Global index of the first document starting at or after `tokens` (a token position)."""
        i = min(int(np.searchsorted(token_base, tokens, side="right")) - 1, len(tfs) - 1)
        local = int(np.searchsorted(tfs[i].offsets[:-1], tokens - token_base[i], side="left"))
        return int(file_first[i]) + local

    # Range k starts at the first document reaching k/num_ranges of the tokens; ties (many empty
    # or tiny documents) are broken by document count so that no range is empty.
    cuts = [0]
    for k in range(1, num_ranges):
        by_tokens = first_doc_at(k * total_tokens / num_ranges)
        cuts.append(min(max(by_tokens, cuts[-1] + 1), total_docs - (num_ranges - k)))
    cuts.append(total_docs)
    ranges = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        segments = []
        for i, t in enumerate(tfs):
            lo, hi = max(a, file_first[i]), min(b, file_first[i + 1])
            if lo < hi:
                segments.append((t.path, int(lo - file_first[i]), int(hi - file_first[i])))
        ranges.append(segments)
    return ranges


def _generate_documents(ranges: list[list[tuple[str, int, int]]]) -> Iterator[dict]:
    """datasets generator: one row per document of the given ranges (in order)."""
    opened: dict[str, TokenFile] = {}
    for segments in ranges:
        for path, first, end in segments:
            tf = opened.get(path) or opened.setdefault(path, TokenFile(path))
            for d in range(first, end):
                yield {TOKEN_FIELD: tf.doc(d)}


def open_token_files(files: list[str], *, num_ranges: int) -> "IterableDataset":
    """A streaming IterableDataset over token files with `num_ranges` shards of equal tokens."""
    from datasets import IterableDataset

    ranges = document_ranges(files, num_ranges)
    if not ranges or all(not seg for seg in ranges):
        raise ValueError(f"token files {files} hold no documents")
    return IterableDataset.from_generator(_generate_documents, gen_kwargs={"ranges": ranges})
