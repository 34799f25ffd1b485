"""A rank that dies in the middle of a ring or a broadcast makes its peers fail with an error that
names the op and the peer, within the collective timeout, instead of hanging."""

import os
import time

import pytest
import torch

from tests.helpers.dist import run_on_ranks
from tsp_trainer.config import model_config
from tsp_trainer.model import Transformer
from tsp_trainer.parallel import zigzag
from tsp_trainer.parallel.mesh import build_mesh
from tsp_trainer.parallel.schemes import parallelize

pytestmark = pytest.mark.distributed


def _die_in(rank, world, block_name):
    cfg = model_config("tiny", num_heads=4, num_kv_heads=2)
    mesh = build_mesh(world)
    model = Transformer(cfg)
    model.init_weights(0)
    parallelize(model, "tsp", mesh, seq_len=16)
    ids = torch.randint(0, cfg.vocab_size, (1, 16))
    li, _, pos = zigzag.shard_batch(ids, ids, rank, world)
    x = model.embed_tokens(li)
    if rank == 1:
        os._exit(3)                               # the peer vanishes mid-schedule
    from tsp_trainer.model.layers import Rotary
    rope = Rotary.build(pos, cfg.head_dim, cfg.rope_theta)
    block = model.layers[0]
    block.mlp(x) if block_name == "mlp" else block.self_attn(x, rope)


# the surviving rank 0 names the dead rank 1: its ring neighbour, or a member of the broadcast group
@pytest.mark.parametrize("block,op,peer", [
    ("mlp", "send/recv of 'mlp.weights' (49152 bytes) on axis 'tsp'",
     "rank 0 sending to global rank 1, receiving from global rank 1 failed"),
    ("attn", "broadcast of 'attn.weights' (24576 bytes) on axis 'tsp'",
     "rank 0 with group global ranks [0, 1], source global rank ")], ids=["mlp", "attn"])
def test_dead_peer_fails_with_op_and_peer(block, op, peer):
    t0 = time.time()
    with pytest.raises(RuntimeError) as info:
        run_on_ranks(_die_in, 2, block, pg_timeout_s=5, timeout=60)
    message = str(info.value)
    assert f"CommError: {op}, {peer}" in message, message[-2000:]
    assert time.time() - t0 < 45                 # bounded by the 5 s collective timeout
