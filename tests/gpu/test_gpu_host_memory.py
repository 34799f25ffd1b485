"""Host memory on the CUDA path, on one GPU: the prefetch worker's batches are pinned and copied to
the device without a host wait (data/prefetch.py); the async checkpoint's staging buffers are
pinned or pageable as checkpoint.pinned_staging says (checkpoint/background.py HostStaging), and
both give the same host copy.

Run with `python -m pytest -m gpu`; without a CUDA device every test here is skipped."""

from __future__ import annotations

import pytest
import torch

from tests.unit.data_helpers import CORPUS, TOKENIZER, take
from tsp_trainer.checkpoint.background import HostStaging
from tsp_trainer.data import PrefetchLoader, build_loader, load_tokenizer
from tsp_trainer.data.prefetch import DEVICE_KEYS, batch_to_device, pins_batches

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA device (torch.cuda.is_available() is False)")]


def test_prefetched_batches_are_pinned_and_reach_the_gpu_unchanged():
    tok = load_tokenizer(TOKENIZER)
    device = torch.device("cuda", torch.cuda.current_device())
    loader = build_loader(CORPUS, tokenizer=tok, seq_len=96, micro_batch_size=3, dp_rank=0, dp_degree=1)
    with PrefetchLoader(loader, depth=2, pin_memory=pins_batches(device)) as pf:
        batches = take(pf, 2)
    for batch in batches:
        assert [batch[k].is_pinned() for k in DEVICE_KEYS] == [True, True]
        on_device = batch_to_device(batch, device)
        torch.cuda.current_stream().synchronize()
        for k, t in zip(DEVICE_KEYS, on_device):
            assert t.device == device and t.cpu().equal(batch[k])


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
def test_host_staging_follows_pinned_staging(pinned):
    live = torch.randn(1024, 64, device="cuda")
    staging = HostStaging(pinned=pinned)
    buf = staging("w", live, "live")
    staging.staged()
    staging.complete()
    assert buf.is_pinned() is pinned and buf.device.type == "cpu"
    assert buf.equal(live.cpu())
