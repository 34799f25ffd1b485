"""Pack tokenised documents into fixed windows of seq_len + 1 tokens, EOS after every document.

Legend: B = micro_batch_size, S = seq_len. The token stream is doc_0 EOS doc_1 EOS ...; window k is
stream[k*S : k*S + S + 1], so consecutive windows share one token and every token after the first is
a label exactly once. A document longer than S continues in the next window: nothing is dropped.
Attention is not masked at document boundaries (standard for packed pre-training); EOS tells the
model a new document starts. Labels are already shifted over the full sequence; the parallel code
takes its zigzag slices of both tensors later (STYLE.md 5.4). Imports torch only.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping

import torch

from tsp_trainer.data.tokenize import TextTokenizer


class TokenPacker:
    """The token stream not yet emitted; `pending()` is what a loader saves to resume exactly."""

    def __init__(self, *, seq_len: int, eos_id: int, pending: Iterable[int] = ()):
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be a positive integer")
        self.seq_len = seq_len
        self.eos_id = eos_id
        self._tokens = list(pending)
        self._start = 0  # tokens before _start were emitted; compacted lazily (no O(n^2) slicing)

    def add_document(self, ids: list[int]) -> None:
        self._tokens.extend(ids)
        self._tokens.append(self.eos_id)

    def num_ready(self) -> int:
        """Complete windows available now (each needs S + 1 tokens; they overlap by one)."""
        return max(0, (len(self._tokens) - self._start - 1) // self.seq_len)

    def pop_window(self) -> list[int]:
        assert self.num_ready() > 0, "pop_window called with fewer than seq_len + 1 tokens pending"
        window = self._tokens[self._start:self._start + self.seq_len + 1]
        # Keep the window's last token: it is the first input of the next window.
        self._start += self.seq_len
        if self._start > len(self._tokens) // 2:
            del self._tokens[:self._start]
            self._start = 0
        return window

    def pending(self) -> list[int]:
        return self._tokens[self._start:]


def windows_to_batch(windows: list[list[int]]) -> dict[str, torch.Tensor]:
    """B windows of S + 1 tokens -> {"input_ids": (B, S), "labels": (B, S)}, labels[t] = ids[t+1]."""
    tokens = torch.tensor(windows, dtype=torch.long)  # (B, S + 1)
    return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}


def pack_documents(docs: Iterable[list[int]], *, seq_len: int, micro_batch_size: int,
                   eos_id: int) -> Iterator[dict[str, torch.Tensor]]:
    """Stateless packing of token lists into micro-batches; a last partial batch is dropped."""
    packer = TokenPacker(seq_len=seq_len, eos_id=eos_id)
    windows: list[list[int]] = []
    for ids in docs:
        packer.add_document(ids)
        while packer.num_ready():
            windows.append(packer.pop_window())
            if len(windows) == micro_batch_size:
                yield windows_to_batch(windows)
                windows = []


class DocumentTokenizer:
    """Row -> token ids, with the checks and counters a long run needs.

    Empty documents are skipped (returns []) and counted. Strings that cannot be UTF-8 encoded
    (lone surrogates from a JSON escape such as "\\udc80", which the Rust tokenizer rejects) are
    repaired, each bad code point becoming '?', and counted. Undecodable bytes in txt files are
    replaced at read time (see streaming.py). A missing or non-string text field is a ValueError.
    """

    def __init__(self, tokenizer: TextTokenizer, *, text_field: str, source: str = "<dataset>"):
        self.tokenizer = tokenizer
        self.text_field = text_field
        self.source = source
        self.num_empty = 0
        self.num_repaired = 0

    def __call__(self, row: Mapping[str, Any], *, where: str) -> list[int]:
        text = row.get(self.text_field) if isinstance(row, Mapping) else None
        if not isinstance(text, str):
            found = "missing" if not isinstance(row, Mapping) or self.text_field not in row \
                else f"of type {type(text).__name__}"
            columns = sorted(row) if isinstance(row, Mapping) else type(row).__name__
            raise ValueError(f"text_field={self.text_field!r} is {found} in {where} of "
                             f"{self.source!r} (columns: {columns}); it must be a string")
        if not text:
            self.num_empty += 1
            return []
        try:
            return self.tokenizer.encode(text)
        except (TypeError, UnicodeEncodeError):
            self.num_repaired += 1
            clean = text.encode("utf-8", errors="replace").decode("utf-8")
            return self.tokenizer.encode(clean)

    def state_dict(self) -> dict[str, int]:
        return {"num_empty": self.num_empty, "num_repaired": self.num_repaired}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.num_empty = int(state["num_empty"])
        self.num_repaired = int(state["num_repaired"])
