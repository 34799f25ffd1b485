"""Passkey haystacks: a number hidden in filler text at a chosen depth, then asked for at the end
(the passkey retrieval test of Mohtashami & Jaggi, "Landmark Attention", arXiv 2305.16300, with the
prompt wording LongLoRA and others reuse; here the filler is real text from a corpus, not one
repeated sentence). One haystack of `length` tokens is

    [bos] intro  filler[:before]  needle  filler[before:]  question  key
    needle   = " The pass key is" key ". Remember it." key " is the pass key."
    question = " What is the pass key? The pass key is"

with before = round(depth x filler tokens): depth 0 puts the needle right after the intro, depth 1
right before the question. The model reads `length` tokens (the last one is the key's second to
last token) and is scored teacher-forced on the key's tokens at the end: the labels are -100
everywhere except the positions that predict a key token. The key is tokenized once and the same
ids appear in the needle and in the answer, so retrieval is a copy the model can make.

Pure Python + torch tensors: tokenizer and filler ids in, one sample out. Nothing here knows the
layout; passkey.py runs the samples under it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterable

import torch

from tsp_trainer.data.tokenize import TextTokenizer
from tsp_trainer.model.transformer import IGNORE_INDEX

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
         "it. I will quiz you about the important information there.")
NEEDLE = (" The pass key is", ". Remember it.", " is the pass key.")   # key goes between the parts
QUESTION = " What is the pass key? The pass key is"


@dataclass(frozen=True)
class Sample:
    """One haystack: input_ids, labels [length] (labels = next token on the key, -100 elsewhere)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    key: str                     # the hidden number
    key_ids: tuple[int, ...]     # its tokens, as they appear in the needle and the answer
    needle_at: int               # position of the needle's first token

    @property
    def key_positions(self) -> range:
        """Positions whose label is a key token (the last len(key_ids) positions)."""
        n = len(self.input_ids)
        return range(n - len(self.key_ids), n)


class HaystackBuilder:
    """Builds the haystacks of one passkey task from a tokenizer and a filler token stream."""

    def __init__(self, tokenizer: TextTokenizer, filler: list[int], *, digits: int = 5, seed: int = 0,
                 bos_id: int | None = None, intro: str = INTRO):
        if digits < 1:
            raise ValueError(f"passkey digits={digits} must be >= 1")
        self.tokenizer, self.filler, self.digits, self.seed = tokenizer, filler, digits, seed
        self.prefix = ([bos_id] if bos_id is not None else []) + (tokenizer.encode(intro) if intro else [])
        self.needle_parts = [tokenizer.encode(p) for p in NEEDLE]
        self.question = tokenizer.encode(QUESTION)

    def key_for(self, sample: int) -> tuple[str, int]:
        """(the key, the filler offset) of sample index `sample`: the same in every (length,
        depth) cell, so cells differ only in where the needle sits and how much filler surrounds it."""
        rng = random.Random(f"passkey:{self.seed}:{sample}")
        key = str(rng.randrange(10 ** (self.digits - 1), 10 ** self.digits))
        return key, rng.randrange(max(len(self.filler), 1))

    def fixed_tokens(self, key: str) -> int:
        """Tokens of a haystack that are not filler."""
        key_ids = self.tokenizer.encode(" " + key)
        needle = sum(len(p) for p in self.needle_parts) + 2 * len(key_ids)
        return len(self.prefix) + needle + len(self.question) + len(key_ids)

    def min_length(self, samples: int) -> int:
        """The shortest haystack (no filler) that holds the keys of samples 0 .. samples - 1, in
        input tokens (a key's token count depends on how the tokenizer merges its digits)."""
        return max(self.fixed_tokens(self.key_for(s)[0]) for s in range(samples)) - 1

    def build(self, length: int, depth: float, sample: int) -> Sample:
        key, offset = self.key_for(sample)
        key_ids = self.tokenizer.encode(" " + key)
        n_fill = length + 1 - self.fixed_tokens(key)        # length inputs + 1 for the last label
        if n_fill and not self.filler:
            raise ValueError("the passkey filler text gave no tokens; point it at a text source "
                             "with documents in it")
        if n_fill < 0:
            need = self.min_length(sample + 1)
            raise ValueError(f"passkey length {length} is shorter than the haystack's fixed text "
                             f"({need} tokens with {self.digits}-digit keys); use lengths >= {need}")
        fill = [self.filler[(offset + i) % len(self.filler)] for i in range(n_fill)]
        before = round(depth * n_fill)
        a, b, c = self.needle_parts
        needle = a + key_ids + b + key_ids + c
        head = self.prefix + fill[:before]
        ids = head + needle + fill[before:] + self.question + key_ids
        # host tensors, as a loader's batch: the caller moves them to the compute device
        tokens = torch.tensor(ids, dtype=torch.long, device="cpu")
        labels = torch.full((length,), IGNORE_INDEX, dtype=torch.long, device="cpu")
        labels[length - len(key_ids):] = tokens[length + 1 - len(key_ids):]
        return Sample(tokens[:-1], labels, key, tuple(key_ids), len(head))


def filler_tokens(texts: Iterable[str], tokenizer: TextTokenizer, *, min_tokens: int) -> list[int]:
    """Tokens of the documents in `texts`, joined by blank lines, until at least `min_tokens` (or
    the texts run out; samples then wrap around the stream)."""
    sep = tokenizer.encode("\n\n")
    out: list[int] = []
    for text in texts:
        if not text:
            continue
        out += tokenizer.encode(text) + sep
        if len(out) >= min_tokens:
            break
    return out
