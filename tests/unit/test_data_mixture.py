"""Mixtures weighted by tokens: weights are shares of the trained tokens, not of
documents; measured on the packed token stream, independently of the mixture's own counters."""

from __future__ import annotations

import json

import pytest

from tests.unit.data_helpers import TOKENIZER, assert_same_batches, take, write_jsonl
from tsp_trainer.config.schema import DataSection, SourceSection
from tsp_trainer.data import build_train_loader, load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory, tok):
    """Short documents of one word and long ones of another: ~8x apart in mean length, and
    disjoint token sets (except EOS), so every token's source can be read off the stream."""
    root = tmp_path_factory.mktemp("mix")
    short = write_jsonl(root / "short.jsonl", [" ".join(["x"] * (3 + i % 5)) for i in range(400)])
    long = write_jsonl(root / "long.jsonl", [" ".join(["y"] * (60 + i % 40)) for i in range(60)])
    ids_a = set(tok.encode(" ".join(["x"] * 9)))
    ids_b = set(tok.encode(" ".join(["y"] * 9)))
    assert not ids_a & ids_b and tok.eos_id not in ids_a | ids_b
    return short, long, ids_a, ids_b


def _mixture(short, long, weights, **kw) -> DataSection:
    sources = [SourceSection(source=str(short), weight=weights[0], name="short"),
               SourceSection(source=str(long), weight=weights[1], name="long")]
    return DataSection(source=None, sources=sources, tokenizer=str(TOKENIZER), seq_len=64,
                       micro_batch_size=4, prefetch=0, mixture_estimate_docs=64, **kw)


def _share_of_short(batches, ids_a, ids_b, eos) -> float:
    """Tokens of the short source (EOS counted with the document it ends) / all tokens."""
    stream = [int(batches[0]["input_ids"][0, 0])]
    for b in batches:
        stream += b["labels"].reshape(-1).tolist()
    a = b_ = 0
    for prev, t in zip([None] + stream, stream):
        src = t if t != eos else prev
        a += src in ids_a
        b_ += src in ids_b
    return a / (a + b_)


def test_70_30_by_tokens_within_2_points(two_sources, tok):
    short, long, ids_a, ids_b = two_sources
    loader = build_train_loader(_mixture(short, long, [0.7, 0.3]), tokenizer=tok, dp_rank=0,
                                dp_degree=1, seed=0, grad_accum=1)
    batches = take(loader, 750)                           # 3,000 sequences of 64 tokens
    share = _share_of_short(batches, ids_a, ids_b, tok.eos_id)
    assert abs(share - 0.7) <= 0.02, share
    mix = loader.documents
    assert abs(loader.stats["token_share/short"] - share) < 0.005       # its own count agrees
    # The long documents are ~8x longer, so the short source needs most of the draws:
    # p(doc) = (w / L) / sum(w / L).
    la, lb = mix.mean_tokens
    assert 6 < lb / la < 10
    pa = (0.7 / la) / (0.7 / la + 0.3 / lb)
    assert mix.probabilities[0] == pytest.approx(pa) and pa > 0.9
    assert "'short' 70.0% of tokens" in mix.describe() and "p(doc)=" in mix.describe()
    assert any(line.startswith("data: mixture by tokens") for line in loader.describe())  # logged


def test_weights_by_documents_would_miss(two_sources, tok):
    """What interleave_datasets does (probabilities = weights) lands far from 70/30 by tokens."""
    short, long, ids_a, ids_b = two_sources
    loader = build_train_loader(_mixture(short, long, [0.7, 0.3]), tokenizer=tok, dp_rank=0,
                                dp_degree=1, seed=0, grad_accum=1)
    loader.documents.mean_tokens = [1.0, 1.0]             # p(doc) = weight
    share = _share_of_short(take(loader, 300), ids_a, ids_b, tok.eos_id)
    assert share < 0.25, share


def test_mixture_resume_is_exact(two_sources, tok):
    short, long, *_ = two_sources
    data = _mixture(short, long, [0.5, 0.5], shuffle=True, shuffle_buffer=16)
    build = lambda: build_train_loader(data, tokenizer=tok, dp_rank=0, dp_degree=1, seed=4,
                                       grad_accum=1)
    reference = take(build(), 40)
    first = build()
    got = take(first, 17)
    state = json.loads(json.dumps(first.state_dict()))
    assert state["documents"]["kind"] == "mixture" and state["documents"]["draws"] > 0
    second = build()
    second.load_state_dict(state)
    got += take(second, 23)
    assert_same_batches(got, reference)
    other = build_train_loader(_mixture(short, long, [0.6, 0.4], shuffle=True, shuffle_buffer=16),
                               tokenizer=tok, dp_rank=0,
                               dp_degree=1, seed=4, grad_accum=1)
    with pytest.raises(ValueError, match="mixture weights"):
        other.load_state_dict(state)
