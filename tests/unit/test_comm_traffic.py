"""tools/comm_traffic.py on CPU: inside CopyTraffic every Comm op of N bytes on the fake process
group copies N bytes between the scratch buffers (the ledger's payload, op by op), a blocking op
is waited for at once and an async one when its work is waited; ops of no bytes and everything
after the block are left alone."""

from __future__ import annotations

import pytest
import torch

from tsp_trainer.parallel.comm import Comm
from tsp_trainer.parallel.mesh import build_mesh
from tsp_trainer.plan.dry_run import fake_world
from tsp_trainer.tools.comm_traffic import CopyTraffic

D = 4


@pytest.fixture
def tsp():
    with fake_world(D, 0):
        yield build_mesh(D).tsp


def _payload(ledger) -> int:
    return sum(r.nbytes for r in ledger.records if r.op != "send")


def test_each_op_copies_its_ledger_bytes_and_is_waited_as_nccl_waits(tsp):
    x = torch.arange(6, dtype=torch.float32)
    with CopyTraffic("cpu") as traffic:
        tsp.broadcast(x, 0, tag="w")                                         # blocking: waited now
        assert (traffic.copies, traffic.bytes, traffic.waits) == (1, 24, 1)
        work = tsp.all_gather(torch.empty(D * 6), x, tag="kv", async_op=True)
        assert (traffic.copies, traffic.bytes, traffic.waits) == (2, 24 + 96, 1)
        work.wait()                                                          # async: waited here
        assert traffic.waits == 2
        tsp.reduce_scatter(torch.empty(6), torch.ones(D * 6), tag="dkv")
        works = tsp.exchange(x, torch.empty(6), send_to=1, recv_from=D - 1, tag="ring")
        assert traffic.waits == 3 and len(works) == 2
        for w in works:
            w.wait()
        tsp.barrier()                                                        # no bytes: no copy
    assert traffic.copies == 4 and traffic.waits == 5
    assert traffic.bytes == _payload(tsp.ledger) == 24 + 96 + 96 + 24
    assert traffic.by_op == {"broadcast": {"count": 1, "bytes": 24}, "all_gather": {"count": 1, "bytes": 96},
                             "reduce_scatter": {"count": 1, "bytes": 96}, "recv": {"count": 1, "bytes": 24}}
    assert traffic.scratch_bytes == 2 * 96                                  # twice the largest op


def test_the_copy_moves_the_bytes_between_the_scratch_buffers(tsp):
    with CopyTraffic("cpu") as traffic:
        tsp.all_reduce(torch.ones(8), tag="grad")
        src, dst = traffic.scratch()
        src.fill_(7)
        tsp.all_reduce(torch.ones(8), tag="grad")
    assert dst.numel() == 32 and torch.equal(dst, torch.full((32,), 7, dtype=torch.uint8))


def test_outside_the_block_comm_is_untouched(tsp):
    original = Comm._run
    with CopyTraffic("cpu") as traffic:
        assert Comm._run is not original
        with pytest.raises(RuntimeError, match="already active"):
            traffic.__enter__()
    assert Comm._run is original
    tsp.broadcast(torch.ones(4), 0, tag="w")
    assert traffic.copies == 0
