"""The order in which TSP's attention issues, waits for and computes around its transfers
(comm / compute overlap). On CUDA the overlap itself comes from NCCL's stream: an async op
runs beside the kernels issued after it until `wait()` orders the compute stream behind it. So what
decides the overlap is the program order, the same on CPU: each transfer must be *issued* before
the compute it should hide under and *waited* only after it. This test records that order on gloo
ranks: comm events from the ledger's in-flight set (issue of an op; completion of an async op's
wait) and compute events from a dispatch mode (the attention kernels and matmuls), in one list.

Checked, forward and backward, full and selective recompute, 2 and 4 ranks, 1 and 2 head buckets:
- the next item's K/V all-gather is issued before this item's attention kernel runs;
- weight broadcasts are issued ahead: shard r+1's broadcast is issued before shard r's attention;
- backward's dK/dV reduce-scatter of an item is waited only after compute ran (issued, then
  compute, then wait): the owner's dW_o GEMM after its last bucket, the next bucket's attention
  backward kernel within an owner (the q/k/v GEMMs are per owner, so a mid-owner bucket has none of
  its own to hide under) and, under full recompute, the next item's attention forward;
- the weight-gradient reduce to owner r is waited only after compute of the next owner's shard.
"""

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers.dist import run_on_ranks

pytestmark = pytest.mark.distributed

_FLASH_FWD = "_scaled_dot_product_flash_attention_for_cpu"
_FLASH_BWD = "_scaled_dot_product_flash_attention_for_cpu_backward"


class _Recorder(TorchDispatchMode):
    """Compute events: the attention kernels and matmuls, appended to `events`."""

    def __init__(self, events: list):
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in (_FLASH_FWD, _FLASH_BWD, "mm", "addmm_", "addmm"):
            self.events.append(("compute", name))
        return func(*args, **(kwargs or {}))


def _record_comm(ledger, events: list) -> None:
    """Comm events from the ledger's in-flight set. An op's issuing call and (async) its Work share
    one description callable: its first begin() is the issue, its last end() the completion (a
    synchronous op's return, an async op's wait). Both are appended to `events` as
    ('issue' | 'done', op, tag, key); _comm_events() keeps the first issue and the last done."""
    in_flight, begin, end = ledger.in_flight, ledger.in_flight.begin, ledger.in_flight.end
    keep, token_key = [], {}

    def record_begin(describe):
        token = begin(describe)
        text = describe()
        if text.startswith(("all_gather", "reduce_scatter", "broadcast", "reduce", "send/recv")):
            keep.append(describe)                  # ids stay unique while the test runs
            token_key[token] = (text.split(" of ")[0], text.split("'")[1], id(describe))
            events.append(("issue",) + token_key[token])
        return token

    def record_end(token):
        end(token)
        if token in token_key:
            events.append(("done",) + token_key.pop(token))

    in_flight.begin, in_flight.end = record_begin, record_end


def _comm_events(events):
    """One issue (the first) and one done (the last) per op; compute and phase events as they are."""
    first_issue, last_done = {}, {}
    for i, e in enumerate(events):
        if e[0] == "issue":
            first_issue.setdefault(e[3], i)
        elif e[0] == "done":
            last_done[e[3]] = i
    keep = set(first_issue.values()) | set(last_done.values())
    return [e[:3] for i, e in enumerate(events) if e[0] not in ("issue", "done") or i in keep]


def _events(rank, world, recompute, buckets):
    from tests.distributed.tsp_cases import tsp_attention_block

    mesh, attn, rope, x = tsp_attention_block(rank, world, hidden=64, kv_heads=8, seq=16 * world,
                                              buckets=buckets, recompute=recompute)
    events: list = []
    _record_comm(mesh.ledger, events)
    with _Recorder(events):
        events.append(("phase", "forward"))
        y = attn(x, rope)
        events.append(("phase", "backward"))
        y.sum().backward()
    return events


def _phase(events, name):
    start = events.index(("phase", name)) + 1
    rest = events[start:]
    stop = next((i for i, e in enumerate(rest) if e[0] == "phase"), len(rest))
    return rest[:stop]


def _positions(events, kind, op=None, tag=None):
    return [i for i, e in enumerate(events)
            if e[0] == kind and (op is None or e[1] == op) and (tag is None or e[2] == tag)]


def _check_forward(events, items):
    gathers = _positions(events, "issue", "all_gather", "attn.kv")
    kernels = _positions(events, "compute", _FLASH_FWD)
    assert len(gathers) == items, gathers
    # item i's attention kernels run after item i+1's gather was issued
    first_kernel_of_item = _first_after_each(kernels, _positions(events, "done", "all_gather", "attn.kv"))
    for i in range(items - 1):
        assert gathers[i + 1] < first_kernel_of_item[i], (i, gathers, first_kernel_of_item)
    # shard r+1's broadcast is issued before shard r's first attention kernel
    bcasts = _positions(events, "issue", "broadcast", "attn.weights")
    assert len(bcasts) >= 2 and bcasts[1] < kernels[0], (bcasts, kernels[:1])


def _first_after_each(kernels, marks):
    """For each mark (the completion of item i's K/V gather), the first kernel after it."""
    return [next(k for k in kernels if k > m) for m in marks]


def _check_backward(events, items, degree, recompute):
    gathers = _positions(events, "issue", "all_gather", "attn.kv")
    gather_done = _positions(events, "done", "all_gather", "attn.kv")
    kernels = _positions(events, "compute", _FLASH_BWD)
    assert len(gathers) == items and len(gather_done) == items
    first_bwd_kernel = _first_after_each(kernels, gather_done)
    for i in range(items - 1):
        assert gathers[i + 1] < first_bwd_kernel[i], ("K/V gather not prefetched", i)
    scatters = _positions(events, "issue", "reduce_scatter", "attn.dkv")
    scatter_done = _positions(events, "done", "reduce_scatter", "attn.dkv")
    assert len(scatters) == len(scatter_done) == items
    compute = (_positions(events, "compute", "mm") + _positions(events, "compute", "addmm_")
               + kernels)
    for issued, done in zip(scatters, scatter_done):
        assert any(issued < m < done for m in compute), ("dK/dV reduce-scatter not overlapped", issued, done)
    if recompute == "full":           # item i's reduce-scatter runs under item i+1's attention
        forward_kernels = _positions(events, "compute", _FLASH_FWD)
        assert len(forward_kernels) >= items
        for i, (issued, done) in enumerate(list(zip(scatters, scatter_done))[:-1]):
            assert any(issued < k < done for k in forward_kernels), ("dK/dV wait before the next "
                                                                     "item's attention", i)
    reduces = _positions(events, "issue", "reduce", "attn.wgrad")
    reduces_done = _positions(events, "done", "reduce", "attn.wgrad")
    assert len(reduces) == len(reduces_done) == degree
    for issued, done in list(zip(reduces, reduces_done))[:-1]:   # all but the last owner's
        assert any(issued < k < done for k in kernels), ("weight-gradient reduce not overlapped", issued)


@pytest.mark.parametrize("world,buckets", [(2, 1), (4, 2)])
@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_transfers_are_issued_before_the_compute_they_hide_under(world, buckets, recompute):
    items = world * buckets
    for events in run_on_ranks(_events, world, recompute, buckets):
        events = _comm_events(events)
        _check_forward(_phase(events, "forward"), items)
        _check_backward(_phase(events, "backward"), items, world, recompute)
