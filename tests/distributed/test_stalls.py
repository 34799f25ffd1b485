"""A stalled peer (SIGSTOP: alive, connected, silent) makes every other rank fail with CommError
naming the op, the axis and the peers within the collective timeout plus a margin, on 4 CPU
processes: the MLP weight ring, the attention weight broadcast, the K/V all-gather (one TSP group
of 4) and DeepSpeed's ZeRO gradient reduction over dp (DP=2 x TSP=2). Before the timeout, the hang
watchdog dumps each waiting rank's stacks and the op in flight.

A group created without an explicit timeout gets torch's 30-minute default whatever
train.collective_timeout_s says, so this also checks that every axis carries the configured one."""

import json
import time

import pytest

from tests.distributed.stall_cases import stalled_block_rank, stalled_reduction_rank
from tests.helpers.dist import run_on_ranks

pytestmark = pytest.mark.distributed

TIMEOUT_S = 4
# A loaded 2-core machine delays a rank's wake-up and the error's way out by seconds; a group left
# at torch's default would wait 1,800 s, so this margin still separates the two cases.
MARGIN_S = 12


def _reports(out, ranks):
    return {r: json.loads((out / f"rank_{r}.json").read_text()) for r in ranks}


MLP, BCAST, KV = "send/recv of 'mlp.weights'", "broadcast of 'attn.weights'", "all_gather of 'attn.kv'"


@pytest.mark.parametrize("block,op,allowed", [
    ("mlp", MLP, {MLP}),
    # Rank 2 stops before shard 0's broadcast: its source (rank 0) waits in the broadcast, the other
    # receivers got shard 0 and wait in the K/V all-gather that rank 2 never joins.
    ("attn", BCAST, {BCAST, KV}),
    # Rank 2 stops in front of item 0's K/V all-gather. The broadcasts of the next shards were
    # issued ahead (transfers run one step ahead of the compute), so a waiting rank may first
    # reach the wait of a broadcast rank 2 does not serve: either op is the truth for that rank.
    ("kv", KV, {KV, BCAST}),
])
def test_stalled_peer_fails_every_rank_with_op_axis_and_peers(tmp_path, block, op, allowed):
    """Rank 2 stops in front of the op; ranks 0, 1, 3 raise CommError naming the op each waits in,
    the axis and the peers, within the groups' 4 s timeout (the harness's default group has 60 s:
    the mesh's groups must carry their own)."""
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="distributed run failed") as info:
        run_on_ranks(stalled_block_rank, 4, block, 2, TIMEOUT_S, str(tmp_path), pg_timeout_s=60,
                     timeout=90)
    codes = str(info.value).rsplit("exit codes", 1)[1]
    assert codes.count("1") >= 3, codes                    # every waiting rank exits non-zero
    reports = _reports(tmp_path, [0, 1, 3])
    named = set()
    for rank, rep in reports.items():
        message = rep["message"]
        assert rep["type"] == "CommError", rep
        assert "axis 'tsp'" in message and f"rank {rank}" in message, message
        assert "global rank" in message, message             # the peers (ring neighbours / group)
        named |= {o for o in allowed if message.startswith(o)}
        assert any(message.startswith(o) for o in allowed), message
        assert rep["waited_s"] < TIMEOUT_S + MARGIN_S, rep
    assert op in named or block == "kv", reports
    assert time.monotonic() - t0 < 90


@pytest.mark.slow           # DeepSpeed's own collective stalled (~10 s); our ops' stalls run above
def test_stalled_peer_in_zero_gradient_reduction(tmp_path):
    """DP=2 x TSP=2: rank 3 stops when DeepSpeed starts reducing step 2's gradients over its dp
    group [1, 3]. Rank 1 fails with a CommError naming DeepSpeed's reduction, axis 'dp' and ranks
    [1, 3]; ranks 0 and 2 fail too; all within the timeout plus the margin. Every waiting rank's
    hang watchdog (train.hang_dump_s=1.5) dumped its stacks and the op in flight first."""
    out = tmp_path / "run"
    overrides = ["train.steps=4", "checkpoint.enabled=false", f"train.output_dir={out}",
                 f"train.collective_timeout_s={TIMEOUT_S + 4}", "train.hang_dump_s=1.5"]
    with pytest.raises(RuntimeError, match="distributed run failed"):
        run_on_ranks(stalled_reduction_rank, 4, overrides, 3, 2, str(tmp_path),
                     pg_timeout_s=TIMEOUT_S + 4, timeout=150)
    reports = _reports(tmp_path, [0, 1, 2])
    zero = reports[1]["message"]
    assert "DeepSpeed ZeRO" in zero and "axis 'dp' (global ranks [1, 3])" in zero, zero
    for rep in reports.values():
        assert rep["type"] == "CommError", rep
        assert rep["waited_s"] < TIMEOUT_S + 4 + MARGIN_S, rep
    dumps = {r: (out / "hang_dumps" / f"rank_{r:05d}.txt") for r in range(4)}
    # The stopped rank cannot dump the stuck step itself (on a loaded machine its slow first step
    # may have passed hang_dump_s and been dumped, which is what the watchdog is for).
    assert not dumps[3].exists() or "step 2 has run" not in dumps[3].read_text()
    for r in (0, 1, 2):
        text = dumps[r].read_text()
        assert f"[rank {r}] hang watchdog: step 2 has run" in text, text
        assert "communication in flight" in text and "in flight for" in text, text
        assert 'File "' in text and "train_step" in text, text      # faulthandler's stacks
    assert "DeepSpeed ZeRO gradient reduction" in dumps[1].read_text()
