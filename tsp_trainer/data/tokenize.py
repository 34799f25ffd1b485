"""Tokenisers behind one small interface (encode, encode_batch, decode, eos_id, bos_id, vocab_size).

A local tokenizer.json (or a folder holding one) loads with `tokenizers` alone; any other folder or a
Hugging Face Hub name goes through `transformers.AutoTokenizer` (imported lazily: it takes seconds).
`encode_batch` tokenizes many documents in one call into the Rust library, which releases the GIL
and may use several threads (the prefetch worker relies on it). BOS follows the tokenizer: `bos_id`
is the token the tokenizer itself puts before a text when asked to add special tokens (Llama's
`<s>`; none for GPT-2-style BPEs), unless tokenizer_config.json says `"add_bos_token": false`.
Imports nothing of ours but `tsp_trainer.data.streaming`'s path helper and the config's rule for
which tokenizer a run uses; never torch.distributed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tsp_trainer.config.model_source import folder_tokenizer, model_folder, resolve_tokenizer
from tsp_trainer.data.streaming import looks_like_local_path

# Tried in order when a tokenizer.json comes without a tokenizer_config.json naming its EOS token.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")


@dataclass(frozen=True)
class TextTokenizer:
    """What the data pipeline needs from a tokeniser. No special tokens are added by `encode`:
    the packer puts `bos_id` (when not None) before and `eos_id` after every document itself."""

    name: str
    eos_id: int
    vocab_size: int  # max token id + 1, added tokens included (what the embedding must cover)
    _encode: Callable[[str], list[int]] = field(repr=False)
    _decode: Callable[[list[int]], str] = field(repr=False)
    _encode_batch: Callable[[list[str]], list[list[int]]] | None = field(default=None, repr=False)
    bos_id: int | None = None  # put before each document (the tokenizer adds one to a text)

    def encode(self, text: str) -> list[int]:
        return self._encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """encode() of each text, in one call where the backend allows it."""
        if self._encode_batch is None:
            return [self._encode(t) for t in texts]
        return self._encode_batch(texts)

    def decode(self, ids: list[int]) -> str:
        return self._decode(ids)


def load_tokenizer(path_or_name: str | Path | TextTokenizer) -> TextTokenizer:
    """Load a tokenizer.json file, a folder (tokenizer.json or anything AutoTokenizer reads),
    or a Hub name. A path that looks local but does not exist is a ValueError naming it."""
    if isinstance(path_or_name, TextTokenizer):
        return path_or_name
    source = str(path_or_name)
    path = Path(source).expanduser()
    if path.is_file():
        return _from_tokenizer_json(path)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return _from_tokenizer_json(path / "tokenizer.json")
    if path.is_dir():
        return _from_transformers(str(path))
    if looks_like_local_path(source):
        raise ValueError(f"tokenizer path {source!r} does not exist (resolved to {path.resolve()}); "
                         "pass a tokenizer.json, a folder holding one, or a Hub name")
    return _from_transformers(source)


def check_tokenizer_fits(tokenizer: TextTokenizer, model_vocab_size: int) -> None:
    """Every token id must index a row of the model's embedding table."""
    if tokenizer.vocab_size > model_vocab_size:
        raise ValueError(
            f"tokenizer {tokenizer.name!r} has vocab_size={tokenizer.vocab_size} but "
            f"model.vocab_size={model_vocab_size}; ids up to {tokenizer.vocab_size - 1} would index "
            f"past the embedding table. Use model.vocab_size >= {tokenizer.vocab_size} or a smaller "
            "tokenizer")


def _from_tokenizer_json(path: Path) -> TextTokenizer:
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on malformed files
        raise ValueError(f"could not read tokenizer file {str(path)!r}: {exc}") from exc
    vocab = tok.get_vocab(with_added_tokens=True)
    config = _tokenizer_config(path.parent / "tokenizer_config.json")
    eos_token = _token_name(config.get("eos_token"))
    candidates = (eos_token,) if eos_token else EOS_CANDIDATES
    eos_id = next((vocab[t] for t in candidates if t in vocab), None)
    if eos_id is None:
        raise ValueError(f"tokenizer {str(path)!r} has no end-of-text token: looked for "
                         f"{list(candidates)}; name one as eos_token in tokenizer_config.json")
    bos_id = _bos_from(lambda t: tok.encode(t, add_special_tokens=True).ids,
                       lambda t: tok.encode(t, add_special_tokens=False).ids,
                       config.get("add_bos_token"))
    if bos_id is None and config.get("add_bos_token") is True:
        bos_token = _token_name(config.get("bos_token"))
        if bos_token not in vocab:
            raise ValueError(f"tokenizer {str(path)!r}: tokenizer_config.json sets add_bos_token "
                             f"but its bos_token {bos_token!r} is not in the vocabulary")
        bos_id = vocab[bos_token]
    return TextTokenizer(
        name=str(path), eos_id=eos_id, vocab_size=max(vocab.values()) + 1,
        _encode=lambda text: tok.encode(text, add_special_tokens=False).ids,
        _decode=lambda ids: tok.decode(ids, skip_special_tokens=False),
        _encode_batch=lambda texts: [e.ids for e in tok.encode_batch_fast(
            texts, add_special_tokens=False)],
        bos_id=bos_id)


def _tokenizer_config(config_path: Path) -> dict:
    if not config_path.is_file():
        return {}
    return json.loads(config_path.read_text(encoding="utf-8"))


def _token_name(token) -> str | None:
    # transformers writes either "<eos>" or {"content": "<eos>", ...} (AddedToken).
    return token.get("content") if isinstance(token, dict) else token


def _bos_from(with_special: Callable[[str], list[int]], plain: Callable[[str], list[int]],
              add_bos_token: bool | None) -> int | None:
    """The id the tokenizer puts before a text when it adds its special tokens, if any."""
    if add_bos_token is False:
        return None
    probe = "Hello world"
    special, bare = list(with_special(probe)), list(plain(probe))
    if len(special) > len(bare) and special[1:1 + len(bare)] == bare:
        return int(special[0])
    return None


def _from_transformers(name: str) -> TextTokenizer:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(name, trust_remote_code=False)   # never a folder's code
    except Exception as exc:  # OSError offline, HTTP errors, missing files: one message for all
        raise ValueError(f"could not load tokenizer {name!r} with transformers.AutoTokenizer "
                         f"(not a local file or folder either): {exc}") from exc
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer {name!r} defines no eos_token; the packer needs one to mark "
                         "document boundaries")
    # The packer feeds whole documents; silence the 'longer than model_max_length' warning.
    tok.model_max_length = 1 << 62
    bos_id = _bos_from(lambda t: tok.encode(t, add_special_tokens=True),
                       lambda t: tok.encode(t, add_special_tokens=False),
                       getattr(tok, "add_bos_token", None))
    return TextTokenizer(
        name=name, eos_id=int(tok.eos_token_id), vocab_size=len(tok),
        _encode=lambda text: tok.encode(text, add_special_tokens=False),
        _decode=lambda ids: tok.decode(ids, skip_special_tokens=False),
        _encode_batch=lambda texts: tok(texts, add_special_tokens=False)["input_ids"],
        bos_id=bos_id)


# Text every tokenizer can encode: words, digits, punctuation, whitespace runs, non-ASCII.
_PROBE = ("The quick brown fox jumps over the lazy dog. 0123456789 -- x=y+1; print('hi')\n\t"
          "  naive cafe: naïve café, Grüße, 東京, Москва, emoji 🙂. <|end_of_text|> </s>")


def check_same_tokenizer(a: TextTokenizer, b: TextTokenizer, *, a_key: str, b_key: str) -> None:
    """ValueError naming both unless `a` and `b` tokenize alike: same vocab size, end-of-text id
    and ids for a probe text (a copy of the same tokenizer elsewhere passes)."""
    diffs = [f"{what} {x} vs {y}" for what, x, y in (("vocab_size", a.vocab_size, b.vocab_size),
                                                     ("eos id", a.eos_id, b.eos_id))
             if x != y]
    if not diffs and a.encode(_PROBE) != b.encode(_PROBE):
        diffs.append("different token ids for the same text")
    if diffs:
        raise ValueError(f"{a_key}={a.name!r} and the tokenizer of {b_key}={b.name!r} differ "
                         f"({'; '.join(diffs)}); leave data.tokenizer unset to use the model "
                         "folder's tokenizer, or point it at the same tokenizer")


def load_run_tokenizer(data_tokenizer: str | None, model_section) -> TextTokenizer:
    """The run's tokenizer: data.tokenizer, else the model folder's, else the bundled one
    (config/model_source.py). When data.tokenizer is set and the model folder (init_from /
    config_from) holds a tokenizer too, both must tokenize alike."""
    tokenizer = load_tokenizer(resolve_tokenizer(data_tokenizer, model_section))
    source = model_folder(model_section)
    folder = folder_tokenizer(source[1]) if source else None
    if data_tokenizer is not None and folder is not None:
        check_same_tokenizer(tokenizer, load_tokenizer(folder), a_key="data.tokenizer", b_key=source[0])
    return tokenizer
