"""Pack tokenised documents into fixed windows of seq_len + 1 tokens, EOS after every document
(and BOS before it when the tokenizer adds one: `TextTokenizer.bos_id`).

Legend: B = micro_batch_size, S = seq_len. The token stream is [BOS] doc_0 EOS [BOS] doc_1 EOS ...;
window k is stream[k*S : k*S + S + 1] (S may change between windows: a length schedule), so
consecutive windows share one token and every token after the first is a label exactly once. A
document longer than S continues in the next window: nothing is dropped. Attention is not masked at
document boundaries unless asked (standard for packed pre-training; EOS tells the model a new
document starts); with data.document_masking the batch also carries "document_ids", from which
attention stops at every boundary (model/documents.py).
Labels are already shifted over the full sequence; the parallel code takes its zigzag slices of
both tensors later. The stream not yet emitted is one int64 array (8 bytes a token, not a list of
Python ints at ~36): at millions of tokens a window is held once, compactly, and becomes the batch
tensors with one copy. Imports torch and numpy (DocumentTokenizer is re-exported from
documents.py).
"""

from __future__ import annotations

from array import array
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

from tsp_trainer.data.documents import DocumentTokenizer  # noqa: F401  (re-exported)


class TokenPacker:
    """The token stream not yet emitted; `pending()` is what a loader saves to resume exactly."""

    def __init__(self, *, seq_len: int, eos_id: int, bos_id: int | None = None,
                 pending: Iterable[int] = ()):
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be a positive integer")
        self.seq_len = seq_len
        self.eos_id, self.bos_id = eos_id, bos_id
        self._tokens = array("q", pending)      # int64 token ids
        self._start = 0  # tokens before _start were emitted; compacted lazily (no O(n^2) slicing)

    def add_document(self, ids: list[int]) -> None:
        if self.bos_id is not None:
            self._tokens.append(self.bos_id)
        self._tokens.extend(ids)
        self._tokens.append(self.eos_id)

    def num_pending(self) -> int:
        return len(self._tokens) - self._start

    def num_ready(self, seq_len: int | None = None) -> int:
        """Complete windows of `seq_len` (default: the packer's) available now (each needs S + 1
        tokens; they overlap by one)."""
        return max(0, (len(self._tokens) - self._start - 1) // (seq_len or self.seq_len))

    def pop_window(self, seq_len: int | None = None) -> array:
        """The next S + 1 tokens, an int64 array (windows_tensor / list() read it)."""
        seq_len = seq_len or self.seq_len
        assert self.num_ready(seq_len) > 0, "pop_window called with fewer than seq_len + 1 tokens"
        window = self._tokens[self._start:self._start + seq_len + 1]
        # Keep the window's last token: it is the first input of the next window.
        self._start += seq_len
        if self._start > len(self._tokens) // 2:
            del self._tokens[:self._start]
            self._start = 0
        return window

    def pending(self) -> list[int]:
        """The tokens not yet emitted, as plain ints (loader state)."""
        return self._tokens[self._start:].tolist()


def windows_tensor(windows: Sequence[Sequence[int]] | torch.Tensor) -> torch.Tensor:
    """B windows of S + 1 tokens (int64 arrays from the packer, or lists: replayed state) ->
    (B, S + 1) int64, one copy."""
    if isinstance(windows, torch.Tensor):
        return windows.to(torch.long)
    return torch.from_numpy(np.stack([np.asarray(w, dtype=np.int64) for w in windows]))


def windows_to_batch(windows: Sequence[Sequence[int]] | torch.Tensor,
                     eos_id: int | None = None) -> dict[str, torch.Tensor]:
    """B windows of S + 1 tokens -> {"input_ids": (B, S), "labels": (B, S)}, labels[t] = ids[t+1].
    With `eos_id` (document masking) also "document_ids" (B, S): see `document_ids`."""
    tokens = windows_tensor(windows)  # (B, S + 1)
    batch = {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
    if eos_id is not None:
        batch["document_ids"] = document_ids(batch["input_ids"], eos_id)
    return batch


def document_ids(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Per-token document index within each row (B, S) int32: the packer ends every document with
    EOS, so a document starts at the token after an EOS (its BOS when the tokenizer has one).
    Token t's id is the number of EOS among input_ids[:, :t]; a window that begins mid-document
    gives that document id 0. Any document length works."""
    after_eos = torch.zeros_like(input_ids, dtype=torch.int32)
    after_eos[:, 1:] = (input_ids[:, :-1] == eos_id).to(torch.int32)
    return after_eos.cumsum(dim=1, dtype=torch.int32)


def pack_documents(docs: Iterable[list[int]], *, seq_len: int, micro_batch_size: int,
                   eos_id: int, bos_id: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """Stateless packing of token lists into micro-batches; a last partial batch is dropped."""
    packer = TokenPacker(seq_len=seq_len, eos_id=eos_id, bos_id=bos_id)
    windows: list[array] = []
    for ids in docs:
        packer.add_document(ids)
        while packer.num_ready():
            windows.append(packer.pop_window())
            if len(windows) == micro_batch_size:
                yield windows_to_batch(windows)
                windows = []
