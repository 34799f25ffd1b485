"""Documents as token lists, from one DP rank's stream of one source, with an exact resume point.

    _DocumentStream   rows of the rank's IterableDataset in (optionally permuted) blocks, over
                      epochs; its state is the block's start (`IterableDataset.state_dict()`, exact
                      for json, parquet, arrow, text and token files in datasets 5.2.0, also
                      under split_dataset_by_node; verified in tests) plus the read position
    DocumentTokenizer row -> ids for a text column (checks and counters)
    TokenColumn       row -> ids for a column of token ids (pre-tokenized data: no tokenizer)
    TokenDocuments    the two together: `next_document()` returns the next document's ids

TokenDocuments tokenizes a group of upcoming rows in one `encode_batch` call and hands them out
one at a time; the stream advances only as documents are handed out, so the state (the stream
position) never includes a document that was tokenized but not yet used. Resuming re-reads the
current block from its saved start and re-tokenizes, so the documents after a resume equal those
of an uninterrupted run, however often it resumes.

Shuffling is a deterministic block shuffle: this rank's stream is cut into blocks of
`block_size` documents and each block is permuted with a seed made of (seed, epoch, dp_rank,
block index). datasets' own shuffle buffer is not used because its contents are lost on resume
(see `IterableDataset.state_dict`). Between epochs datasets also reshuffles which shards each
rank reads (`set_epoch`). Imports datasets (through the caller's dataset) and numpy only.
"""

from __future__ import annotations

import copy
import itertools
import random
from collections import deque
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import numpy as np

from tsp_trainer.data.read_errors import DataError, read_error
from tsp_trainer.data.tokenize import TextTokenizer

if TYPE_CHECKING:
    from datasets import IterableDataset

# Unshuffled streams are read in blocks too (identity order): a resume re-reads at most this many
# documents, and a block is what one encode_batch call can see ahead.
UNSHUFFLED_BLOCK_DOCS = 32
# One encode_batch call takes up to this many documents / characters (a few books at most).
GROUP_MAX_DOCS = 64
GROUP_MAX_CHARS = 1 << 20


class _DocumentStream:
    """Rows of one DP rank's IterableDataset, in (optionally permuted) blocks, over epochs."""

    def __init__(self, dataset: "IterableDataset", *, describe: str, block_size: int,
                 shuffle: bool, seed: int, dp_rank: int, files: tuple[str, ...] = (),
                 data_format: str = "auto"):
        self._ds = dataset
        self._describe = describe  # "'<source>' split 'train' (dp_rank 0 of dp_degree 2)"
        # the local files behind `dataset` and their format, to name the bad line on a read error
        self._files, self._format = list(files), data_format
        self._block_size, self._shuffle = block_size, shuffle
        self._seed, self._dp_rank = seed, dp_rank
        # Taken before any iteration: loading it (with the epoch patched in) rewinds to the start.
        self._initial_state = dataset.state_dict()
        self._iter: Iterator[dict] | None = None
        self.rewind(0)

    @property
    def describe(self) -> str:
        return self._describe

    def peek(self, max_docs: int, max_chars: int | None = None,
             field: str | None = None) -> list[tuple[dict, str]]:
        """Up to `max_docs` upcoming (row, where) pairs of the current block, without consuming
        them (at least one; `max_chars` of `field` bounds the rest)."""
        if self._block_pos == len(self._block):
            self._next_block()
        out, chars = [], 0
        for i in range(self._block_pos, min(len(self._block), self._block_pos + max_docs)):
            position, row = self._block[i]
            text = row.get(field) if field is not None and isinstance(row, Mapping) else None
            size = len(text) if isinstance(text, str) else 0
            if out and max_chars is not None and chars + size > max_chars:
                break
            chars += size
            out.append((row, self._where(position)))
        return out

    def next_row(self) -> tuple[dict, str]:
        """The next row and where it came from (for error messages)."""
        if self._block_pos == len(self._block):
            self._next_block()
        position, row = self._block[self._block_pos]
        self._block_pos += 1
        self.docs_in_epoch += 1
        return row, self._where(position)

    def _where(self, position: int) -> str:
        return f"document {position} (0-based) of {self._describe}, epoch {self.epoch}"

    def _next_block(self) -> None:
        first = self.docs_in_epoch
        start_state, rows = self._read_block()
        if not rows:
            if self.docs_in_epoch == 0:
                raise ValueError(f"dataset {self._describe} yielded no documents; check the path, "
                                 "the split and that dp_degree is not larger than the row count")
            self.rewind(self.epoch + 1)
            first = 0
            start_state, rows = self._read_block()
            if not rows:
                raise ValueError(f"dataset {self._describe} yielded no documents in epoch "
                                 f"{self.epoch} after yielding some in epoch {self.epoch - 1}")
        self._block_index += 1
        self._set_block(start_state, rows, first=first, pos=0)

    def _read_block(self, size: int | None = None) -> tuple[dict | None, list[dict]]:
        if self._iter is None:
            raise RuntimeError(f"the loader of {self._describe} was closed; call "
                               "load_state_dict() to reopen it or build a new one")
        # Before its first row, a fresh iterator's state_dict() still shows the previous pass,
        # so the block start is then the state the iterator was started from.
        start_state = self._start_state if self._fresh else self._ds.state_dict()
        try:
            rows = list(itertools.islice(self._iter, size or self._block_size))
        except Exception as exc:  # noqa: BLE001 - pyarrow, datasets and codecs each raise their own
            # pyarrow fails a whole batch of json/parquet rows (invalid JSON, bytes that are not
            # UTF-8), so the bad row cannot be skipped alone; txt files are decoded with replacement.
            raise read_error(exc, files=self._files, data_format=self._format,
                             describe=f"dataset {self._describe}",
                             near=f"near document {self.docs_in_epoch} of epoch {self.epoch}") from exc
        self._fresh = self._fresh and not rows
        return start_state, rows

    def _set_block(self, start_state: dict | None, rows: list[dict], *, first: int,
                   pos: int) -> None:
        order = list(range(len(rows)))
        if self._shuffle:
            # A str seed is hashed with SHA-512 by random.seed: stable across processes and runs.
            key = f"{self._seed}:{self.epoch}:{self._dp_rank}:{self._block_index}"
            random.Random(key).shuffle(order)
        self._block = [(first + i, rows[i]) for i in order]
        self._block_state, self._block_pos = start_state, pos

    def _restart(self, epoch: int, state: dict | None) -> None:
        """Point the dataset iterator at `state` (None: the start of `epoch`)."""
        self.close()  # let the previous reader release its files now
        self.epoch = epoch
        self._ds.set_epoch(epoch)
        # datasets applies a loaded state only when its "epoch" equals the dataset's epoch, and
        # re-applies it on every later iter(): so always load one, the rewind state included.
        rewind = copy.deepcopy(self._initial_state) | {"epoch": epoch}
        self._ds.load_state_dict(copy.deepcopy(state) if state is not None else rewind)
        self._iter = iter(self._ds)
        self._start_state, self._fresh = copy.deepcopy(state), True

    def rewind(self, epoch: int) -> None:
        """Go to the start of `epoch`, dropping the current block."""
        self._restart(epoch, None)
        self.docs_in_epoch, self._block_index = 0, -1
        self._block, self._block_pos, self._block_state = [], 0, None

    def close(self) -> None:
        if self._iter is not None:
            self._iter.close()
            self._iter = None

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "docs_in_epoch": self.docs_in_epoch,
                "block_state": copy.deepcopy(self._block_state), "block_index": self._block_index,
                "block_len": len(self._block), "block_pos": self._block_pos}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._restart(int(state["epoch"]), state["block_state"])
        self.docs_in_epoch = int(state["docs_in_epoch"])
        self._block_index = int(state["block_index"])
        self._block, self._block_pos, self._block_state = [], 0, None
        if state["block_len"] == 0:
            return
        # Re-read the block from its saved start (exactly as many rows as it had, whatever the
        # block size is now); the same rows give the same permutation.
        start_state, rows = self._read_block(int(state["block_len"]))
        if len(rows) != state["block_len"]:
            raise ValueError(f"dataset {self._describe} changed since the loader state was saved: "
                             f"the current block had {state['block_len']} documents, now "
                             f"{len(rows)}")
        first = self.docs_in_epoch - int(state["block_pos"])
        self._set_block(start_state, rows, first=first, pos=int(state["block_pos"]))


class DocumentTokenizer:
    """Row -> token ids, with the checks and counters a long run needs.

    Empty documents are skipped (returns []) and counted. Strings that cannot be UTF-8 encoded
    (lone surrogates from a JSON escape such as "\\udc80", which the Rust tokenizer rejects) are
    repaired, each bad code point becoming '?', and counted. Undecodable bytes in txt files are
    replaced at read time (see streaming.py). A missing or non-string text field is a ValueError.
    """

    field_kind = "text"

    def __init__(self, tokenizer: TextTokenizer, *, text_field: str, source: str = "<dataset>"):
        self.tokenizer = tokenizer
        self.text_field = text_field
        self.source = source
        self.num_empty = 0
        self.num_repaired = 0

    @property
    def field(self) -> str:
        return self.text_field

    def __call__(self, row: Mapping[str, Any], *, where: str) -> list[int]:
        ids, repaired = self.encode_rows([row], [where])[0]
        self.num_empty += not ids
        self.num_repaired += repaired
        return ids

    def _text(self, row: Mapping[str, Any], where: str) -> str:
        text = row.get(self.text_field) if isinstance(row, Mapping) else None
        if not isinstance(text, str):
            found = "missing" if not isinstance(row, Mapping) or self.text_field not in row \
                else f"of type {type(text).__name__}"
            columns = sorted(row) if isinstance(row, Mapping) else type(row).__name__
            raise DataError(f"text_field={self.text_field!r} is {found} in {where} of "
                             f"{self.source!r} (columns: {columns}); it must be a string")
        return text

    def encode_rows(self, rows: list[Mapping[str, Any]],
                    wheres: list[str]) -> list[tuple[list[int], bool]]:
        """(token ids, repaired) of each row, the non-empty texts in one encode_batch call."""
        texts = [self._text(row, where) for row, where in zip(rows, wheres)]
        todo = [i for i, t in enumerate(texts) if t]
        out: list[tuple[list[int], bool]] = [([], False) for _ in texts]
        try:
            encoded = [(ids, False) for ids in self.tokenizer.encode_batch([texts[i] for i in todo])]
        except Exception:  # noqa: BLE001 - backends raise TypeError, UnicodeEncodeError or Exception
            # One bad string fails the whole batch; redo it one text at a time with repair.
            encoded = [self._encode_one(texts[i]) for i in todo]
        for i, (ids, repaired) in zip(todo, encoded):
            out[i] = (list(ids), repaired)
        return out

    def _encode_one(self, text: str) -> tuple[list[int], bool]:
        try:
            return self.tokenizer.encode(text), False
        except (TypeError, UnicodeEncodeError):
            clean = text.encode("utf-8", errors="replace").decode("utf-8")
            return self.tokenizer.encode(clean), True

    def state_dict(self) -> dict[str, int]:
        return {"num_empty": self.num_empty, "num_repaired": self.num_repaired}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.num_empty = int(state["num_empty"])
        self.num_repaired = int(state["num_repaired"])


class TokenColumn:
    """Row -> token ids for pre-tokenized data: a column of integer ids (a list, or a numpy
    array from a token file), each checked to index the model's vocabulary."""

    field_kind = "token"

    def __init__(self, *, token_field: str, vocab_size: int, source: str = "<dataset>"):
        self.token_field, self.vocab_size, self.source = token_field, vocab_size, source

    @property
    def field(self) -> str:
        return self.token_field

    def encode_rows(self, rows: list[Mapping[str, Any]],
                    wheres: list[str]) -> list[tuple[list[int], bool]]:
        return [(self._ids(row, where), False) for row, where in zip(rows, wheres)]

    def _ids(self, row: Mapping[str, Any], where: str) -> list[int]:
        ids = row.get(self.token_field) if isinstance(row, Mapping) else None
        if ids is None or isinstance(ids, (str, bytes)):
            found = "missing" if ids is None else f"of type {type(ids).__name__}"
            raise DataError(f"token_field={self.token_field!r} is {found} in {where} of "
                             f"{self.source!r}; it must be a list of token ids")
        arr = np.asarray(ids)
        if arr.size == 0:
            return []
        if arr.ndim != 1 or arr.dtype.kind not in "iu" or arr.min() < 0 \
                or arr.max() >= self.vocab_size:
            raise DataError(f"token_field={self.token_field!r} in {where} of {self.source!r} "
                             f"holds {arr.dtype} values in [{arr.min()}, {arr.max()}]; token ids "
                             f"must be integers in [0, {self.vocab_size}) (the model's vocabulary)")
        return arr.tolist()


class TokenDocuments:
    """One source's documents for one DP rank: `next_document()` -> token ids ([] = empty)."""

    def __init__(self, stream: _DocumentStream, reader: DocumentTokenizer | TokenColumn, *,
                 name: str = "data"):
        self._stream, self._reader, self.name = stream, reader, name
        self._ready: deque[tuple[list[int], bool]] = deque()   # tokenized, not yet handed out
        self.docs = 0                              # documents handed out, all epochs
        self.tokens = 0                            # their tokens (no BOS/EOS)
        self.num_empty = 0                         # of them: empty (skipped by the packer)
        self.num_repaired = 0                      # of them: text repaired to valid UTF-8
        self._nonempty_in_epoch = 0                # to refuse looping forever over empty documents
        self._epoch_seen = stream.epoch
        self._seen_chars, self._seen_tokens = 0, 0
        self._chars_per_token = 4.0                # English BPE; learned from the data as it goes

    @property
    def epoch(self) -> int:
        return self._stream.epoch

    def _learn_ratio(self, rows: list, encoded: list[tuple[list[int], bool]]) -> None:
        """Characters per token of the text seen so far (sizes the next group)."""
        field = self._reader.field
        chars = sum(len(r.get(field)) for r in rows
                    if isinstance(r, Mapping) and isinstance(r.get(field), str))
        tokens = sum(len(ids) for ids, _ in encoded)
        if chars and tokens:
            self._seen_chars += chars
            self._seen_tokens += tokens
            self._chars_per_token = self._seen_chars / self._seen_tokens

    def next_document(self, want_tokens: int | None = None) -> list[int]:
        """The next document's ids. `want_tokens` (what the packer still needs) sizes the group
        tokenized ahead: about that many tokens' worth of text, at least one document."""
        if not self._ready:
            chars = GROUP_MAX_CHARS if want_tokens is None else \
                min(GROUP_MAX_CHARS, int(want_tokens * self._chars_per_token * 1.25) + 1)
            group = self._stream.peek(GROUP_MAX_DOCS, chars, self._reader.field)
            rows = [r for r, _ in group]
            encoded = self._reader.encode_rows(rows, [w for _, w in group])
            self._learn_ratio(rows, encoded)
            self._ready.extend(encoded)
        ids, repaired = self._ready.popleft()
        self._stream.next_row()                    # the row just tokenized (peek did not consume)
        if self._stream.epoch != self._epoch_seen:
            if self._nonempty_in_epoch == 0:
                raise ValueError(f"every document of {self._stream.describe} is empty; nothing "
                                 "to train on")
            self._epoch_seen, self._nonempty_in_epoch = self._stream.epoch, 0
        self.docs += 1
        self.tokens += len(ids)
        self.num_empty += not ids
        self.num_repaired += repaired
        self._nonempty_in_epoch += bool(ids)
        return ids

    def rewind(self) -> None:
        self._stream.rewind(0)
        self._ready.clear()
        self.docs = self.tokens = self._nonempty_in_epoch = 0
        self.num_empty = self.num_repaired = 0
        self._epoch_seen = self._stream.epoch

    def close(self) -> None:
        self._stream.close()

    def stats(self) -> dict[str, int]:
        return {"epoch": self.epoch, "docs": self.docs, "tokens": self.tokens,
                "docs_empty": self.num_empty, "docs_repaired": self.num_repaired}

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "single", "stream": self._stream.state_dict(),
                "counters": {"num_empty": self.num_empty, "num_repaired": self.num_repaired},
                "docs": self.docs, "tokens": self.tokens,
                "nonempty_docs_in_epoch": self._nonempty_in_epoch}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("kind", "single") != "single":
            raise ValueError(f"loader state holds a {state.get('kind')} of sources but this run "
                             f"reads one source ({self.name!r}); an exact resume needs the same "
                             "data.source / data.sources / data.upsample settings")
        self._ready.clear()
        self._stream.load_state_dict(state["stream"])
        self.num_empty = int(state["counters"]["num_empty"])
        self.num_repaired = int(state["counters"]["num_repaired"])
        self.docs, self.tokens = int(state["docs"]), int(state.get("tokens", 0))
        self._nonempty_in_epoch = int(state["nonempty_docs_in_epoch"])
        self._epoch_seen = self._stream.epoch
