"""PackedLoader: this DP rank's packed micro-batches, epoch after epoch, with an exact resume point.

Each DP rank saves its own `state_dict()` (plain Python: ints, lists, the datasets state dict):
  layout   dp_rank, dp_degree, seq_len, micro_batch_size, shuffle, seed, shuffle_buffer
  stream   epoch, docs_in_epoch, and the resume point of the current block of documents: the
           `IterableDataset.state_dict()` taken at the block's start (exact for json, parquet and
           text in datasets 5.2.0, also under split_dataset_by_node; verified in tests), the block's
           index, length and read position
  buffer   token_buffer: tokens of consumed documents not yet emitted
Resuming re-reads the current block from its saved start and skips what was consumed, so the
batches after a resume equal those of an uninterrupted run, however often it resumes.

Shuffling is a deterministic block shuffle: this rank's stream is cut into blocks of
`shuffle_buffer` documents and each block is permuted with a seed made of (seed, epoch, dp_rank,
block index). datasets' own shuffle buffer is not used because its contents are lost on resume
(see `IterableDataset.state_dict`). For a global shuffle, write the shards in random order offline.
Imports torch, datasets (through streaming.py) and our data modules; never torch.distributed.
"""

from __future__ import annotations

import copy
import itertools
import random
import warnings
from typing import TYPE_CHECKING, Any, Iterator, Literal, Mapping

import torch

from tsp_trainer.data.packing import DocumentTokenizer, TokenPacker, windows_to_batch
from tsp_trainer.data.streaming import check_dp_layout, open_text_stream
from tsp_trainer.data.tokenize import TextTokenizer, load_tokenizer

if TYPE_CHECKING:
    from datasets import IterableDataset

STATE_VERSION = 1
LayoutPolicy = Literal["error", "restart", "resplit"]


class _DocumentStream:
    """Rows of one DP rank's IterableDataset, in (optionally permuted) blocks, over epochs."""

    def __init__(self, dataset: "IterableDataset", *, describe: str, block_size: int,
                 shuffle: bool, seed: int, dp_rank: int):
        self._ds = dataset
        self._describe = describe  # "'<source>' split 'train' (dp_rank 0 of dp_degree 2)"
        self._block_size, self._shuffle = block_size, shuffle
        self._seed, self._dp_rank = seed, dp_rank
        # Taken before any iteration: loading it (with the epoch patched in) rewinds to the start.
        self._initial_state = dataset.state_dict()
        self._iter: Iterator[dict] | None = None
        self.rewind(0)

    def next_row(self) -> tuple[dict, str]:
        """The next row and where it came from (for error messages)."""
        if self._block_pos == len(self._block):
            self._next_block()
        position, row = self._block[self._block_pos]
        self._block_pos += 1
        self.docs_in_epoch += 1
        return row, f"document {position} (0-based) of {self._describe}, epoch {self.epoch}"

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

    def _read_block(self) -> tuple[dict | None, list[dict]]:
        if self._iter is None:
            raise RuntimeError(f"the loader of {self._describe} was closed; call "
                               "load_state_dict() to reopen it or build a new one")
        # Before its first row, a fresh iterator's state_dict() still shows the previous pass,
        # so the block start is then the state the iterator was started from.
        start_state = self._start_state if self._fresh else self._ds.state_dict()
        try:
            rows = list(itertools.islice(self._iter, self._block_size))
        except UnicodeDecodeError as exc:
            # pyarrow keeps json/parquet strings as raw bytes and fails when converting the batch,
            # so the bad row cannot be skipped alone; txt files are decoded with replacement.
            raise ValueError(f"dataset {self._describe} has text that is not valid UTF-8 near "
                             f"document {self.docs_in_epoch} of epoch {self.epoch}: {exc}; "
                             "re-encode the file as UTF-8") from exc
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

    def skip(self, num_docs: int) -> None:
        """Consume up to `num_docs` rows without returning them; stops at the end of the epoch."""
        epoch = self.epoch
        for _ in range(num_docs):
            self.next_row()
            if self.epoch != epoch:
                break

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
        # Re-read the block from its saved start; the same rows give the same permutation.
        start_state, rows = self._read_block()
        if len(rows) != state["block_len"]:
            raise ValueError(f"dataset {self._describe} changed since the loader state was saved: "
                             f"the current block had {state['block_len']} documents, now "
                             f"{len(rows)}")
        first = self.docs_in_epoch - int(state["block_pos"])
        self._set_block(start_state, rows, first=first, pos=int(state["block_pos"]))


class PackedLoader:
    """Iterator over this DP rank's micro-batches {"input_ids": (B, S), "labels": (B, S)} (int64).

    `dataset` must already be this DP rank's stream (`open_text_stream(..., dp_rank, dp_degree)`,
    or use `build_loader`). Never ends: when the stream is exhausted the next epoch starts.
    """

    def __init__(self, dataset: "IterableDataset", *, tokenizer: TextTokenizer | str,
                 seq_len: int, micro_batch_size: int, dp_rank: int = 0, dp_degree: int = 1,
                 text_field: str = "text", shuffle: bool = False, seed: int = 0,
                 shuffle_buffer: int = 1024, source: str = "<dataset>", split: str = "train"):
        check_dp_layout(dp_rank=dp_rank, dp_degree=dp_degree)
        for key, value in (("seq_len", seq_len), ("micro_batch_size", micro_batch_size),
                           ("shuffle_buffer", shuffle_buffer)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{key}={value!r} must be a positive integer")
        self.tokenizer = load_tokenizer(tokenizer)
        self.seq_len, self.micro_batch_size = seq_len, micro_batch_size
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.shuffle, self.seed, self.shuffle_buffer = shuffle, seed, shuffle_buffer
        self.source, self.split = str(source), split
        describe = f"{self.source!r} split {split!r} (dp_rank {dp_rank} of dp_degree {dp_degree})"
        # Without shuffling a block is one document, so the resume point is the last document.
        self._docs = _DocumentStream(dataset, describe=describe, seed=seed, dp_rank=dp_rank,
                                     block_size=shuffle_buffer if shuffle else 1, shuffle=shuffle)
        self._doc_tokenizer = DocumentTokenizer(self.tokenizer, text_field=text_field,
                                                source=self.source)
        self._packer = TokenPacker(seq_len=seq_len, eos_id=self.tokenizer.eos_id)
        self._reset_counters()

    def _reset_counters(self) -> None:
        self.docs_consumed = 0          # documents read from this rank's stream, all epochs
        self.batches = 0                # micro-batches returned
        self._nonempty_in_epoch = 0     # to refuse looping forever over empty documents
        self._epoch_seen = self._docs.epoch

    def __iter__(self) -> "PackedLoader":
        return self

    def close(self) -> None:
        """Release the reader's files now. A parquet reader left open until interpreter exit
        prints 'Exception ignored in: <generator object Parquet._generate_tables>' (datasets 5.2.0).
        Reading on raises RuntimeError; load_state_dict() reopens the loader."""
        self._docs.close()

    def __enter__(self) -> "PackedLoader":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __next__(self) -> dict[str, torch.Tensor]:
        while self._packer.num_ready() < self.micro_batch_size:
            self._add_next_document()
        windows = [self._packer.pop_window() for _ in range(self.micro_batch_size)]
        self.batches += 1
        return windows_to_batch(windows)  # {"input_ids": (B, S), "labels": (B, S)}

    def _add_next_document(self) -> None:
        row, where = self._docs.next_row()
        if self._docs.epoch != self._epoch_seen:
            if self._nonempty_in_epoch == 0:
                raise ValueError(f"every document of {self.source!r} split {self.split!r} "
                                 f"(dp_rank {self.dp_rank}) is empty; nothing to train on")
            self._epoch_seen, self._nonempty_in_epoch = self._docs.epoch, 0
        ids = self._doc_tokenizer(row, where=where)
        self.docs_consumed += 1
        if ids:
            self._packer.add_document(ids)
            self._nonempty_in_epoch += 1

    @property
    def stats(self) -> dict[str, int]:
        return {"epoch": self._docs.epoch, "docs_consumed": self.docs_consumed,
                "docs_empty": self._doc_tokenizer.num_empty,
                "docs_repaired": self._doc_tokenizer.num_repaired, "batches": self.batches}

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly here; plain Python types only."""
        return {
            "version": STATE_VERSION, "dp_rank": self.dp_rank, "dp_degree": self.dp_degree,
            "seq_len": self.seq_len, "micro_batch_size": self.micro_batch_size,
            "shuffle": self.shuffle, "seed": self.seed, "shuffle_buffer": self.shuffle_buffer,
            "source": self.source, "split": self.split,
            "stream": self._docs.state_dict(), "token_buffer": self._packer.pending(),
            "docs_consumed": self.docs_consumed, "batches": self.batches,
            "nonempty_docs_in_epoch": self._nonempty_in_epoch,
            "counters": self._doc_tokenizer.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any], *,
                        on_layout_change: LayoutPolicy = "error") -> None:
        """Continue from `state`. Under a different dp_degree: "error" (default) raises;
        "restart" starts this rank's stream from scratch; "resplit" approximates this rank's
        position from the documents consumed globally, see `_resplit`."""
        if on_layout_change not in ("error", "restart", "resplit"):
            raise ValueError(f"on_layout_change={on_layout_change!r}; use 'error', 'restart' "
                             "or 'resplit'")
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"loader state version {state.get('version')!r} is not "
                             f"{STATE_VERSION}; it was written by another tsp_trainer version")
        if state["dp_degree"] != self.dp_degree:
            self._change_layout(state, on_layout_change)
            return
        if state["dp_rank"] != self.dp_rank:
            raise ValueError(f"loader state of dp_rank={state['dp_rank']} loaded on "
                             f"dp_rank={self.dp_rank}; each DP rank must load its own state")
        self._check_compatible(state)
        self._docs.load_state_dict(state["stream"])
        self._packer = TokenPacker(seq_len=self.seq_len, eos_id=self.tokenizer.eos_id,
                                   pending=state["token_buffer"])
        self._doc_tokenizer.load_state_dict(state["counters"])
        self.docs_consumed, self.batches = int(state["docs_consumed"]), int(state["batches"])
        self._nonempty_in_epoch = int(state["nonempty_docs_in_epoch"])
        self._epoch_seen = self._docs.epoch

    def _change_layout(self, state: Mapping[str, Any], policy: LayoutPolicy) -> None:
        if policy == "error":
            raise ValueError(
                f"loader state was saved with dp_degree={state['dp_degree']} but this run has "
                f"dp_degree={self.dp_degree}; pass on_layout_change='restart' to start the data "
                "stream over, or 'resplit' to approximate the position (see PackedLoader docs)")
        warnings.warn(f"dp_degree changed {state['dp_degree']} -> {self.dp_degree}: data loader "
                      f"on_layout_change={policy!r}; the resumed data order is not exact",
                      stacklevel=3)
        self._docs.rewind(0)
        self._packer = TokenPacker(seq_len=self.seq_len, eos_id=self.tokenizer.eos_id)
        self._reset_counters()
        if policy == "resplit":
            self._resplit(state)

    def _resplit(self, state: Mapping[str, Any]) -> None:
        """Approximate: assumes every old rank consumed as many documents in the current epoch as
        the one whose state is given, so the epoch's global count is docs_in_epoch * old degree;
        this rank then skips its 1/dp_degree share of that. The count is kept, not the identity
        of the documents (some may repeat or be skipped this epoch), and the old token buffer is
        dropped. Cost: the skipped documents are read (not tokenised)."""
        stream = state["stream"]
        global_docs = int(stream["docs_in_epoch"]) * int(state["dp_degree"])
        self._docs.rewind(int(stream["epoch"]))
        self._epoch_seen = self._docs.epoch
        self._docs.skip(global_docs // self.dp_degree)

    def _check_compatible(self, state: Mapping[str, Any]) -> None:
        saved = (state["shuffle"], state["seed"],
                 state["shuffle_buffer"] if state["shuffle"] else 0)
        now = (self.shuffle, self.seed, self.shuffle_buffer if self.shuffle else 0)
        if saved != now:
            raise ValueError(f"loader state was saved with (shuffle, seed, shuffle_buffer)={saved} "
                             f"but this loader has {now}; an exact resume needs the same values")
        for key in ("seq_len", "micro_batch_size", "source", "split"):
            if state[key] != getattr(self, key):
                # The buffer is plain tokens, so the stream continues without loss.
                warnings.warn(f"loader state has {key}={state[key]!r}, this loader "
                              f"{getattr(self, key)!r}; continuing from the saved position",
                              stacklevel=3)


def build_loader(source: str, *, tokenizer: TextTokenizer | str, seq_len: int,
                 micro_batch_size: int, split: str = "train", text_field: str = "text",
                 dp_rank: int = 0, dp_degree: int = 1, seed: int = 0, shuffle: bool = False,
                 shuffle_buffer: int = 1024, config_name: str | None = None,
                 load_kwargs: Mapping[str, Any] | None = None) -> PackedLoader:
    """Open `source` for this DP rank and wrap it in a PackedLoader (plain arguments only)."""
    dataset = open_text_stream(source, split=split, text_field=text_field, dp_rank=dp_rank,
                               dp_degree=dp_degree, config_name=config_name,
                               load_kwargs=load_kwargs)
    return PackedLoader(dataset, tokenizer=tokenizer, seq_len=seq_len,
                        micro_batch_size=micro_batch_size, dp_rank=dp_rank, dp_degree=dp_degree,
                        text_field=text_field, shuffle=shuffle, seed=seed,
                        shuffle_buffer=shuffle_buffer, source=str(source), split=split)


def iterate_eval_batches(source: str, *, tokenizer: TextTokenizer | str, seq_len: int,
                         micro_batch_size: int, num_batches: int, split: str = "validation",
                         text_field: str = "text", dp_rank: int = 0, dp_degree: int = 1,
                         load_kwargs: Mapping[str, Any] | None = None
                         ) -> Iterator[dict[str, torch.Tensor]]:
    """The same `num_batches` held-out micro-batches on every call, unshuffled from the start.
    A split shorter than that wraps around, so every DP rank yields exactly `num_batches`
    (an evaluation loop that all-reduces per batch must not have one rank stop early)."""
    loader = build_loader(source, tokenizer=tokenizer, seq_len=seq_len,
                          micro_batch_size=micro_batch_size, split=split, text_field=text_field,
                          dp_rank=dp_rank, dp_degree=dp_degree, shuffle=False,
                          load_kwargs=load_kwargs)
    with loader:
        for _ in range(num_batches):
            yield next(loader)
