"""A synthetic passkey-retrieval corpus: documents that are haystacks themselves (haystack.py's
prompt, filler from real text, a random key at a random depth, the answer at the end), so that a
small model trained on it learns to copy the key and the passkey metric has something to measure.
Used by the tests and by the example in docs/long_context/evaluation.md; `tsp-eval retrieval-corpus` writes it.

The documents take their filler from the source's train split and their keys from `seed` (1 by
default), the evaluation from the validation split and seed 0: the model cannot have seen the
evaluated haystacks.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tsp_trainer.data.tokenize import TextTokenizer
from tsp_trainer.eval.evaluator import read_filler
from tsp_trainer.eval.haystack import INTRO, HaystackBuilder

FILLER_TOKENS = 262_144     # filler read per split, at most


def check_lengths(tokenizer: TextTokenizer, *, docs: int, min_tokens: int, max_tokens: int,
                  digits: int, seed: int, intro: str = INTRO) -> None:
    shortest = HaystackBuilder(tokenizer, [], digits=digits, seed=seed, intro=intro).min_length(docs)
    if min_tokens < shortest or max_tokens < min_tokens:
        raise ValueError(f"document lengths {min_tokens}..{max_tokens} tokens: the prompt alone takes "
                         f"{shortest}; use --min-tokens >= {shortest} and --max-tokens >= --min-tokens")


def retrieval_documents(tokenizer: TextTokenizer, filler: list[int], *, docs: int, min_tokens: int,
                        max_tokens: int, digits: int = 5, seed: int = 1, intro: str = INTRO) -> list[str]:
    """`docs` haystack texts of min_tokens..max_tokens tokens, needle at a uniform random depth
    (`intro`: the haystack's opening instruction; "" for none)."""
    check_lengths(tokenizer, docs=docs, min_tokens=min_tokens, max_tokens=max_tokens, digits=digits,
                  seed=seed, intro=intro)
    builder = HaystackBuilder(tokenizer, filler, digits=digits, seed=seed, intro=intro)
    rng = random.Random(f"retrieval-corpus:{seed}")
    out = []
    for i in range(docs):
        sample = builder.build(rng.randint(min_tokens, max_tokens), rng.random(), i)
        ids = sample.input_ids.tolist() + [sample.key_ids[-1]]      # the whole haystack, answer included
        out.append(tokenizer.decode(ids) + ".")
    return out


def write_retrieval_corpus(out: str | Path, *, tokenizer: TextTokenizer, text: str, docs: int = 4000,
                           min_tokens: int = 128, max_tokens: int = 256, digits: int = 5,
                           seed: int = 1) -> Path:
    """train.jsonl (`docs` documents, filler from `text`'s train split) and validation.jsonl
    (docs / 10, filler from its validation split, other keys) in folder `out`."""
    out = Path(out)
    splits = (("train", docs, seed), ("validation", max(1, docs // 10), seed + 1000))
    for _, n, split_seed in splits:                    # before reading any text
        check_lengths(tokenizer, docs=n, min_tokens=min_tokens, max_tokens=max_tokens,
                      digits=digits, seed=split_seed)
    out.mkdir(parents=True, exist_ok=True)
    for split, n, split_seed in splits:
        # documents start at random offsets of the filler: a bounded stream is enough
        filler = read_filler(text, split=split, text_field="text", tokenizer=tokenizer,
                             min_tokens=min(n * max_tokens, FILLER_TOKENS))
        texts = retrieval_documents(tokenizer, filler, docs=n, min_tokens=min_tokens,
                                    max_tokens=max_tokens, digits=digits, seed=split_seed)
        tmp = out / f".{split}.jsonl.tmp"
        tmp.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        tmp.replace(out / f"{split}.jsonl")
    return out
