"""The prefetch worker: the same batches as the loader alone, a checkpoint that
holds the queued batches so resume is exact (into a prefetching or a plain loader), errors raised
in the training loop at the batch they belong to, and a worker that stops when asked."""

from __future__ import annotations

import json
import threading
import time

import pytest

from tests.unit.data_helpers import CORPUS, TOKENIZER, assert_same_batches, take, write_jsonl
from tsp_trainer.data import PrefetchLoader, build_loader, load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TOKENIZER)


def _loader(tok, source=CORPUS, **kw):
    args = dict(tokenizer=tok, seq_len=96, micro_batch_size=3, dp_rank=1, dp_degree=2,
                shuffle=True, seed=5, shuffle_buffer=24) | kw
    return build_loader(str(source), **args)


def _wait_until_full(pf: PrefetchLoader, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while len(pf._queue) < pf.depth and time.time() < deadline:
        time.sleep(0.01)
    assert len(pf._queue) == pf.depth


def test_prefetch_yields_the_loader_batches(tok):
    reference = take(_loader(tok), 12)
    with PrefetchLoader(_loader(tok), depth=2) as pf:
        assert_same_batches(take(pf, 12), reference)
        assert pf.stats["batches"] >= 12 and pf.stats["epoch"] == 0


@pytest.mark.parametrize("resume_with_prefetch", [True, False])
def test_queued_batches_are_saved_and_resume_is_exact(tok, resume_with_prefetch):
    reference = take(_loader(tok), 20)
    pf = PrefetchLoader(_loader(tok), depth=2)
    got = take(pf, 7)
    _wait_until_full(pf)                       # the worker is 2 batches ahead when we save
    state = json.loads(json.dumps(pf.state_dict()))    # plain Python, any checkpoint can hold it
    pf.close()
    assert len(state["replay"]) == 2 and state["batches"] == 9
    resumed = _loader(tok)
    if resume_with_prefetch:
        resumed = PrefetchLoader(resumed, depth=2)
    resumed.load_state_dict(state)
    got += take(resumed, 13)
    assert_same_batches(got, reference)
    # Saving again mid-replay keeps what is still queued or unreplayed.
    again = resumed.state_dict()
    resumed.close()
    with PrefetchLoader(_loader(tok), depth=1) as third:
        third.load_state_dict(again)
        assert_same_batches(take(third, 3), take(_loader_after(tok, 20), 3))


def _loader_after(tok, n):
    loader = _loader(tok)
    take(loader, n)
    return loader


def test_worker_error_reaches_the_training_loop_at_its_batch(tmp_path, tok):
    texts = [f"fine document {i} " * 30 for i in range(6)]
    path = tmp_path / "d.jsonl"
    write_jsonl(path, texts)
    with path.open("a") as f:
        f.write('{"text": null}\n')
    plain = _loader(tok, path, dp_rank=0, dp_degree=1, shuffle=False, seq_len=32, micro_batch_size=1)
    good = 0
    with pytest.raises(ValueError):
        while True:
            next(plain)
            good += 1
    pf = PrefetchLoader(_loader(tok, path, dp_rank=0, dp_degree=1, shuffle=False, seq_len=32,
                                micro_batch_size=1), depth=2)
    take(pf, good)                                  # every good batch arrives first
    with pytest.raises(ValueError, match="text_field='text' is of type NoneType in document 6"):
        next(pf)
    assert not pf._thread                           # the worker ended with the error
    pf.close()


def test_worker_stops_on_close_and_is_named(tok):
    pf = PrefetchLoader(_loader(tok), depth=2)
    next(pf)
    worker = pf._thread
    assert worker.name == "tsp-data-prefetch" and worker.daemon and worker in threading.enumerate()
    pf.close()
    assert not worker.is_alive()
    with pytest.raises(ValueError, match="data.prefetch=0 must be >= 1"):
        PrefetchLoader(_loader(tok), depth=0)
