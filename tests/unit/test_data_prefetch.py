"""The prefetch worker: the same batches as the loader alone, a checkpoint that
holds the queued batches so resume is exact (into a prefetching or a plain loader), errors raised
in the training loop at the batch they belong to, and a worker that stops when asked."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from tests.unit.data_helpers import CORPUS, TOKENIZER, assert_same_batches, take, write_jsonl
from tsp_trainer.data import PrefetchLoader, build_loader, load_tokenizer
from tsp_trainer.data.prefetch import DEVICE_KEYS, batch_to_device, pins_batches


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


class _CopyLog(torch.overrides.TorchFunctionMode):
    """Records (source tensor, non_blocking) of every Tensor.to call."""

    def __init__(self):
        super().__init__()
        self.copies = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to:
            self.copies.append((args[0], kwargs.get("non_blocking", False)))
        return func(*args, **kwargs)


def test_batches_are_pinned_for_cuda_only_and_copied_non_blocking(tok, monkeypatch):
    """A CUDA device pins (input_ids, labels) on the worker, a CPU one does not; the Trainer's copy
    of a batch reads the pinned tensors with non_blocking=True. (This machine has no CUDA, so
    pin_memory() is replaced by a clone that is remembered as pinned.)"""
    pinned = []

    def fake_pin(self):
        copy = self.clone()
        pinned.append(copy)
        return copy

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    assert pins_batches(torch.device("cuda", 0)) and pins_batches("cuda")
    assert not pins_batches(torch.device("cpu")) and not pins_batches("meta")
    reference = take(_loader(tok), 2)
    with PrefetchLoader(_loader(tok), depth=2, pin_memory=pins_batches("cuda")) as pf:
        batches = take(pf, 2)
    assert_same_batches(batches, reference)
    # (input_ids, labels) of every batch the worker made: the 2 handed out, and a third when the
    # worker got to it before the loader closed
    assert len(pinned) == 2 * pf.loader.batches and pf.loader.batches >= 2
    handed_out = [b[k] for b in batches for k in DEVICE_KEYS]
    assert [any(t is p for p in pinned) for t in handed_out] == [True] * 4
    with _CopyLog() as log:
        ids, labels = batch_to_device(batches[0], torch.device("meta"))
    assert [(src is batches[0][k], nb) for (src, nb), k in zip(log.copies, DEVICE_KEYS)] == [(True, True)] * 2
    assert ids.device.type == labels.device.type == "meta"
    pinned.clear()
    with PrefetchLoader(_loader(tok), depth=2, pin_memory=pins_batches("cpu")) as pf:
        take(pf, 2)
    assert pinned == []
