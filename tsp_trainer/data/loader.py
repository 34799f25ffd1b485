"""PackedLoader: this DP rank's packed micro-batches, epoch after epoch, with an exact resume point.

The loader pulls documents (token lists) from a document source and packs them:

    TokenDocuments      one source (text tokenized in groups, or a column of token ids)
    MixtureDocuments    several sources weighted by tokens (mixture.py)
    LongDocUpsampler    long documents repeated (upsample.py), around either of them

and cuts windows of the shape the length schedule gives for each micro-batch (schedule.py).

Each DP rank saves its own `state_dict()` (plain Python: ints, lists, the datasets state dicts):
  layout     dp_rank, dp_degree, seq_len, micro_batch_size, shuffle, seed, shuffle_buffer
  documents  the document source's state (stream positions, mixture draws, pending copies)
  buffer     token_buffer: tokens of consumed documents not yet emitted; replay: batches already
             cut but not yet trained on (the prefetch worker's queue), handed out first
  counters   batches (which fixes the schedule's stage), docs_consumed
Resuming puts every source back where it was, so the batches after a resume equal those of an
uninterrupted run, however often it resumes. Imports torch and our data modules; never
torch.distributed.
"""

from __future__ import annotations

import warnings
from collections import deque
from typing import TYPE_CHECKING, Any, Iterator, Literal, Mapping, Sequence

import torch

from tsp_trainer.data.documents import (UNSHUFFLED_BLOCK_DOCS, DocumentTokenizer, TokenColumn,
                                        TokenDocuments, _DocumentStream)
from tsp_trainer.data.packing import TokenPacker, windows_to_batch
from tsp_trainer.data.schedule import LengthSchedule
from tsp_trainer.data.streaming import (check_column, check_dp_layout, open_text_stream,
                                        resolve_local_files)
from tsp_trainer.data.tokenize import TextTokenizer, load_tokenizer

if TYPE_CHECKING:
    from datasets import IterableDataset

STATE_VERSION = 2
LayoutPolicy = Literal["error", "restart"]


class PackedLoader:
    """Iterator over this DP rank's micro-batches {"input_ids": (B, S), "labels": (B, S)} (int64).

    `documents` is this DP rank's stream (`open_text_stream(..., dp_rank, dp_degree)`, or use
    `build_loader`), or an already built document source (TokenDocuments, MixtureDocuments,
    LongDocUpsampler). Never ends: when a stream is exhausted its next epoch starts. B and S follow
    `schedule` (default: micro_batch_size and seq_len for the whole run).
    """

    def __init__(self, documents: "IterableDataset | Any", *, tokenizer: TextTokenizer | str,
                 seq_len: int, micro_batch_size: int, dp_rank: int = 0, dp_degree: int = 1,
                 text_field: str = "text", token_field: str | None = None, shuffle: bool = False,
                 seed: int = 0, shuffle_buffer: int = 1024, source: str = "<dataset>",
                 split: str = "train", schedule: LengthSchedule | None = None,
                 document_ids: bool = False):
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
        self.schedule = schedule or LengthSchedule.constant(seq_len, micro_batch_size)
        # data.document_masking: each batch also carries "document_ids" (B, S), cut at EOS
        self.document_ids = document_ids
        if hasattr(documents, "next_document"):
            self.documents = documents
        else:
            self.documents = token_documents(
                documents, tokenizer=self.tokenizer, source=self.source, split=split,
                dp_rank=dp_rank, dp_degree=dp_degree, text_field=text_field,
                token_field=token_field, shuffle=shuffle, seed=seed, shuffle_buffer=shuffle_buffer)
        self._packer = self._new_packer()
        self._replay: deque[list[list[int]]] = deque()   # batches made before a save, not yet used
        self.docs_consumed = 0          # documents handed to the packer, all epochs
        self.batches = 0                # micro-batches cut from the packer (replays not counted)

    def _new_packer(self, pending=()) -> TokenPacker:
        return TokenPacker(seq_len=self.seq_len, eos_id=self.tokenizer.eos_id,
                           bos_id=self.tokenizer.bos_id, pending=pending)

    def __iter__(self) -> "PackedLoader":
        return self

    def close(self) -> None:
        """Release the readers' files now. A parquet reader left open until interpreter exit
        prints 'Exception ignored in: <generator object Parquet._generate_tables>' (datasets 5.2.0).
        Reading on raises RuntimeError; load_state_dict() reopens the loader."""
        self.documents.close()

    def __enter__(self) -> "PackedLoader":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def next_windows(self) -> list[Sequence[int]]:
        """The next micro-batch as B windows of S + 1 tokens (S, B from the schedule): the
        packer's int64 arrays, or the lists of a replayed batch."""
        if self._replay:
            return self._replay.popleft()
        seq_len, micro = self.schedule.shape_of_batch(self.batches)
        while self._packer.num_ready(seq_len) < micro:
            ids = self.documents.next_document(micro * seq_len + 1 - self._packer.num_pending())
            self.docs_consumed += 1
            if ids:
                self._packer.add_document(ids)
        windows = [self._packer.pop_window(seq_len) for _ in range(micro)]
        self.batches += 1
        return windows

    def __next__(self) -> dict[str, torch.Tensor]:
        # {"input_ids": (B, S), "labels": (B, S)[, "document_ids": (B, S)]}
        return windows_to_batch(self.next_windows(), self.document_eos)

    @property
    def document_eos(self) -> int | None:
        """The EOS id that cuts documents when batches carry document ids, else None."""
        return self.tokenizer.eos_id if self.document_ids else None

    def describe(self) -> list[str]:
        """Lines for the start-up log: the mixture's estimates, upsampling, the length schedule."""
        lines, docs = [], self.documents
        if hasattr(docs, "min_tokens"):
            lines.append(f"data: documents of >= {docs.min_tokens} tokens are trained on "
                         f"{docs.factor:g}x on average (copies {docs.gap_docs} documents apart)")
            docs = docs.inner
        if hasattr(docs, "describe"):
            lines.append(f"data: {docs.describe()} (dp rank {self.dp_rank})")
        if len(self.schedule.stages) > 1:
            lines.append("data: length schedule " + ", ".join(
                f"from step {s.start_step}: {s.micro_batch_size} x {s.seq_len} tokens"
                for s in self.schedule.stages))
        if self.document_ids:
            lines.append(f"data: document masking: each batch carries document ids cut after EOS "
                         f"(id {self.tokenizer.eos_id}); attention stops at every document boundary")
        return lines

    @property
    def stats(self) -> dict[str, Any]:
        inner = self.documents.stats()
        return {**inner, "epoch": self.documents.epoch, "docs_consumed": self.docs_consumed,
                "batches": self.batches}

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly here; plain Python types only."""
        return {
            "version": STATE_VERSION, "dp_rank": self.dp_rank, "dp_degree": self.dp_degree,
            "seq_len": self.seq_len, "micro_batch_size": self.micro_batch_size,
            "shuffle": self.shuffle, "seed": self.seed, "shuffle_buffer": self.shuffle_buffer,
            "source": self.source, "split": self.split, "schedule": self.schedule.to_list(),
            "documents": self.documents.state_dict(), "token_buffer": self._packer.pending(),
            "replay": [[list(w) for w in windows] for windows in self._replay],
            "docs_consumed": self.docs_consumed, "batches": self.batches,
        }

    def load_state_dict(self, state: Mapping[str, Any], *,
                        on_layout_change: LayoutPolicy = "error") -> None:
        """Continue from `state`. Under a different dp_degree: "error" (default) raises;
        "restart" starts this rank's stream from scratch (the run's data order then differs
        from an uninterrupted run; see docs/data.md for why there is no exact re-split)."""
        if on_layout_change not in ("error", "restart"):
            hint = (" ('resplit' was removed: it only approximated the position, repeating and "
                    "skipping documents; see docs/data.md)" if on_layout_change == "resplit" else "")
            raise ValueError(f"on_layout_change={on_layout_change!r}; use 'error' or "
                             f"'restart'{hint}")
        state = upgrade_state(state)
        if state["dp_degree"] != self.dp_degree:
            self._change_layout(state, on_layout_change)
            return
        if state["dp_rank"] != self.dp_rank:
            raise ValueError(f"loader state of dp_rank={state['dp_rank']} loaded on "
                             f"dp_rank={self.dp_rank}; each DP rank must load its own state")
        self._check_compatible(state)
        self.documents.load_state_dict(state["documents"])
        self._packer = self._new_packer(state["token_buffer"])
        self._replay = deque([list(map(list, windows)) for windows in state.get("replay", [])])
        self.docs_consumed, self.batches = int(state["docs_consumed"]), int(state["batches"])

    def _change_layout(self, state: Mapping[str, Any], policy: LayoutPolicy) -> None:
        if policy == "error":
            raise ValueError(
                f"loader state was saved with dp_degree={state['dp_degree']} but this run has "
                f"dp_degree={self.dp_degree}; pass on_layout_change='restart' to start the data "
                "stream over (see docs/data.md)")
        # the user chose this (data.on_layout_change=restart): the resume logs it, no warning
        self.documents.rewind()
        self._packer = self._new_packer()
        self._replay.clear()
        self.docs_consumed = 0
        # The schedule follows the run's steps, not the data: keep the saved micro-batch count.
        self.batches = int(state["batches"])

    def _check_compatible(self, state: Mapping[str, Any]) -> None:
        saved = (state["shuffle"], state["seed"],
                 state["shuffle_buffer"] if state["shuffle"] else 0)
        now = (self.shuffle, self.seed, self.shuffle_buffer if self.shuffle else 0)
        if saved != now:
            raise ValueError(f"loader state was saved with (shuffle, seed, shuffle_buffer)={saved} "
                             f"but this loader has {now}; an exact resume needs the same values")
        now = {"seq_len": self.seq_len, "micro_batch_size": self.micro_batch_size,
               "source": self.source, "split": self.split, "schedule": self.schedule.to_list()}
        for key, value in now.items():
            if state.get(key) is not None and state[key] != value:
                # The buffer is plain tokens, so the stream continues without loss.
                warnings.warn(f"loader state has {key}={state[key]!r}, this loader {value!r}; "
                              "continuing from the saved position", stacklevel=3)


def upgrade_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """A state of any version this code reads, as the current version (plain dicts)."""
    version = state.get("version")
    if version == STATE_VERSION:
        return dict(state)
    if version == 1:    # one source; the stream's fields were at the top level
        documents = {"kind": "single", "stream": state["stream"], "counters": state["counters"],
                     "docs": state["docs_consumed"], "tokens": 0,
                     "nonempty_docs_in_epoch": state["nonempty_docs_in_epoch"]}
        return {**state, "version": STATE_VERSION, "documents": documents, "schedule": None}
    raise ValueError(f"loader state version {version!r} is not 1 or {STATE_VERSION}; it was "
                     "written by another tsp_trainer version")


def token_documents(dataset: "IterableDataset", *, tokenizer: TextTokenizer, source: str,
                    split: str, dp_rank: int, dp_degree: int, text_field: str = "text",
                    token_field: str | None = None, shuffle: bool = False, seed: int = 0,
                    shuffle_buffer: int = 1024, name: str | None = None,
                    data_format: str = "auto") -> TokenDocuments:
    """One source's documents for one DP rank: a text column tokenized, or a token-id column."""
    describe = f"{source!r} split {split!r} (dp_rank {dp_rank} of dp_degree {dp_degree})"
    fmt, files = _files_behind(source, split=split, data_format=data_format)
    stream = _DocumentStream(dataset, describe=describe, seed=seed, dp_rank=dp_rank,
                             block_size=shuffle_buffer if shuffle else UNSHUFFLED_BLOCK_DOCS,
                             shuffle=shuffle, files=tuple(files), data_format=fmt)
    if token_field is not None:
        reader = TokenColumn(token_field=token_field, vocab_size=tokenizer.vocab_size,
                             source=source)
    else:
        reader = DocumentTokenizer(tokenizer, text_field=text_field, source=source)
    return TokenDocuments(stream, reader, name=name or source)


def _files_behind(source: str, *, split: str, data_format: str) -> tuple[str, list[str]]:
    """(format, local files) of a source, to name a bad line on a read error; ("hub", []) for a
    Hub name or a dataset handed in without a path."""
    try:
        local = resolve_local_files(source, split=split, data_format=data_format)
    except ValueError:
        local = None
    return local if local is not None else ("hub", [])


def open_documents(source: str, *, tokenizer: TextTokenizer, split: str = "train",
                   text_field: str = "text", token_field: str | None = None,
                   data_format: str = "auto", dp_rank: int = 0, dp_degree: int = 1, seed: int = 0,
                   shuffle: bool = False, shuffle_buffer: int = 1024, config_name: str | None = None,
                   load_kwargs: Mapping[str, Any] | None = None, max_example_split_dp: int = 8,
                   mode: str = "train", name: str | None = None) -> TokenDocuments:
    """Open `source` for this DP rank as a TokenDocuments (pre-tokenized when token_field is set
    or the source is a token file / tsp-tokenize folder)."""
    from tsp_trainer.data.pretokenized import resolve_token_field

    token_field = resolve_token_field(str(source), token_field=token_field, data_format=data_format,
                                      split=split, tokenizer=tokenizer)
    dataset = open_text_stream(source, split=split, text_field=token_field or text_field,
                               dp_rank=dp_rank, dp_degree=dp_degree, config_name=config_name,
                               load_kwargs=load_kwargs, data_format=data_format,
                               max_example_split_dp=max_example_split_dp, mode=mode)
    if token_field is not None:
        check_column(dataset, token_field, source=str(source), split=split, key="token_field")
    return token_documents(dataset, tokenizer=tokenizer, source=str(source), split=split,
                           dp_rank=dp_rank, dp_degree=dp_degree, text_field=text_field,
                           token_field=token_field, shuffle=shuffle, seed=seed,
                           shuffle_buffer=shuffle_buffer, name=name, data_format=data_format)


def build_loader(source: str, *, tokenizer: TextTokenizer | str, seq_len: int,
                 micro_batch_size: int, split: str = "train", text_field: str = "text",
                 token_field: str | None = None, data_format: str = "auto", dp_rank: int = 0,
                 dp_degree: int = 1, seed: int = 0, shuffle: bool = False,
                 shuffle_buffer: int = 1024, config_name: str | None = None,
                 load_kwargs: Mapping[str, Any] | None = None, max_example_split_dp: int = 8,
                 mode: str = "train", schedule: LengthSchedule | None = None,
                 document_ids: bool = False) -> PackedLoader:
    """Open `source` for this DP rank and wrap it in a PackedLoader (plain arguments only)."""
    tok = load_tokenizer(tokenizer)
    documents = open_documents(source, tokenizer=tok, split=split, text_field=text_field,
                               token_field=token_field, data_format=data_format, dp_rank=dp_rank,
                               dp_degree=dp_degree, seed=seed, shuffle=shuffle,
                               shuffle_buffer=shuffle_buffer, config_name=config_name,
                               load_kwargs=load_kwargs, max_example_split_dp=max_example_split_dp,
                               mode=mode)
    return PackedLoader(documents, tokenizer=tok, seq_len=seq_len,
                        micro_batch_size=micro_batch_size, dp_rank=dp_rank, dp_degree=dp_degree,
                        shuffle=shuffle, seed=seed, shuffle_buffer=shuffle_buffer,
                        source=str(source), split=split, schedule=schedule,
                        document_ids=document_ids)


def iterate_eval_batches(source: str, *, tokenizer: TextTokenizer | str, seq_len: int,
                         micro_batch_size: int, num_batches: int, split: str = "validation",
                         text_field: str = "text", dp_rank: int = 0, dp_degree: int = 1,
                         load_kwargs: Mapping[str, Any] | None = None
                         ) -> Iterator[dict[str, torch.Tensor]]:
    """The same `num_batches` held-out micro-batches on every call, unshuffled from the start.
    A split shorter than that wraps around, so every DP rank yields exactly `num_batches`
    (an evaluation loop that all-reduces per batch must not have one rank stop early).
    The Trainer uses eval.EvalBatches, which builds its loader once."""
    loader = build_loader(source, tokenizer=tokenizer, seq_len=seq_len,
                          micro_batch_size=micro_batch_size, split=split, text_field=text_field,
                          dp_rank=dp_rank, dp_degree=dp_degree, shuffle=False,
                          load_kwargs=load_kwargs, mode="eval")
    with loader:
        for _ in range(num_batches):
            yield next(loader)
