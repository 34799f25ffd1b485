"""Comm's direct all-gather and reduce-scatter on gloo (parallel/comm.py): the same results as
gloo's own collectives, blocking and asynchronous, several in flight at once, fp32 and bf16, on
2 and 4 ranks; the ledger records the same op and bytes; nothing is in flight after the waits."""

import pytest
import torch

from tests.helpers.dist import run_on_ranks

pytestmark = pytest.mark.distributed


def _compare(rank, world):
    from tsp_trainer.parallel.mesh import build_mesh

    mesh = build_mesh(world)
    comm = mesh.tsp
    assert comm.direct_exchanges                       # gloo group of more than one rank
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(rank)
        # shapes as TSP uses them: K/V [B, T, 2, H, d] gathered, dK/dV [D, B, T, 2, H, d] scattered
        kv = [torch.randn(1, 6, 2, 2, 4, generator=gen).to(dtype) for _ in range(3)]
        dkv = [torch.randn(world, 1, 6, 2, 2, 4, generator=gen).to(dtype) for _ in range(3)]
        results = {}
        for direct in (True, False):
            comm.direct_exchanges = direct
            mesh.ledger.reset()
            gathered = [x.new_empty((world * x.shape[0],) + x.shape[1:]) for x in kv]
            scattered = [x.new_empty(x.shape[1:]) for x in dkv]
            # three of each in flight at once, waited in order (as TSP's prefetch does), then one
            # blocking call of each
            works = [comm.all_gather(g, x, tag="t.kv", async_op=True) for g, x in zip(gathered, kv)]
            works += [comm.reduce_scatter(s, x.view((-1,) + x.shape[2:]), tag="t.dkv", async_op=True)
                      for s, x in zip(scattered, dkv)]
            for w in works:
                w.wait()
            blocking_g = kv[0].new_empty((world,) + kv[0].shape[1:])
            comm.all_gather(blocking_g, kv[0], tag="t.kv")
            blocking_s = dkv[0].new_empty(dkv[0].shape[1:])
            comm.reduce_scatter(blocking_s, dkv[0].view((-1,) + dkv[0].shape[2:]), tag="t.dkv")
            assert not mesh.ledger.in_flight.describe()
            results[direct] = (gathered, scattered, blocking_g, blocking_s,
                               mesh.ledger.bytes_by("op", "tag"), mesh.ledger.count())
        out[str(dtype)] = results
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_direct_exchanges_match_gloo_collectives(world):
    outs = run_on_ranks(_compare, world)
    for rank, out in enumerate(outs):
        for dtype, res in out.items():
            direct, native = res[True], res[False]
            for a, b in zip(direct[0] + [direct[2]], native[0] + [native[2]]):
                assert torch.equal(a, b), (rank, dtype)           # all-gather: bytes moved only
            # reduce-scatter: a sum of world blocks; gloo's order of addition may differ
            tol = {"atol": 1e-6, "rtol": 1e-6} if "float32" in dtype else {"atol": 3e-2, "rtol": 2e-2}
            for a, b in zip(direct[1] + [direct[3]], native[1] + [native[3]]):
                torch.testing.assert_close(a, b, **tol)
            assert direct[4] == native[4] and direct[5] == native[5]   # ledger: same ops, bytes
    # and the sum is the sum: rank r's block of the reduce-scatter = sum over ranks of block r
    ins = []
    for rank in range(world):
        gen = torch.Generator().manual_seed(rank)
        [torch.randn(1, 6, 2, 2, 4, generator=gen) for _ in range(3)]     # the K/V draws first
        ins.append([torch.randn(world, 1, 6, 2, 2, 4, generator=gen) for _ in range(3)])
    for rank, out in enumerate(outs):
        scattered = out["torch.float32"][True][1]
        for i in range(3):
            expected = sum(ins[src][i][rank] for src in range(world))
            torch.testing.assert_close(scattered[i], expected, atol=1e-6, rtol=1e-6)
