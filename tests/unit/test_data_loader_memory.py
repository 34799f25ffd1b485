"""The packed loader's host memory follows seq_len, not the corpus: tracemalloc's peak while a
loader (bundled tokenizer, document ids on) builds three sequences grows with the sequence length
(two int64 copies of the window) and stays the same on a corpus four times larger. The figure at 7.34M tokens is in
docs/long_context/millions_of_tokens.md."""

from __future__ import annotations

import shutil
import tracemalloc

import pytest

from tests.unit.data_helpers import CORPUS, TOKENIZER
from tsp_trainer.data import build_loader

SEQ = 65536
BATCHES = 3


def traced_peak(corpus, seq_len: int) -> int:
    """Bytes of Python allocations at the peak while the loader builds BATCHES sequences."""
    loader = build_loader(str(corpus), tokenizer=str(TOKENIZER), seq_len=seq_len,
                          micro_batch_size=1, shuffle=True, shuffle_buffer=64, document_ids=True)
    with loader:
        tracemalloc.start()
        try:
            for _ in range(BATCHES):
                batch = next(loader)
                assert batch["document_ids"].shape == (1, seq_len)
                del batch
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()


@pytest.fixture(scope="module")
def four_times_the_corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus4x")
    for copy in range(4):
        for i, src in enumerate(sorted(CORPUS.glob("train-*.jsonl"))):
            shutil.copy(src, folder / f"train-{2 * copy + i:05d}-of-00008.jsonl")
    return folder


def test_loader_memory_follows_seq_len_not_the_corpus(four_times_the_corpus):
    small = traced_peak(CORPUS, SEQ)
    bigger_corpus = traced_peak(four_times_the_corpus, SEQ)
    longer = traced_peak(CORPUS, 4 * SEQ)
    assert bigger_corpus < 1.2 * small, (small, bigger_corpus)       # not O(corpus)
    # O(seq_len): each more token costs its place in the packer's int64 buffer and in the (B, S + 1)
    # array the window is stacked into, 8 bytes each (a list of Python ints would be ~36 bytes a
    # token on its own). tracemalloc does not see torch's allocations: the batch tensors add their
    # dtypes' 20 bytes a token (ids and labels int64, document ids int32) beside this.
    per_token = (longer - small) / (3 * SEQ)
    assert 8 < per_token < 30, (small, longer, per_token)
