"""Rank functions for the stall tests: one rank stops itself (SIGSTOP, as a hung kernel or a frozen
node looks to its peers: alive, connected, silent) just before a chosen op; every other rank writes
what it saw (the error, how long the op waited) to <out>/rank_R.json and re-raises."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch

from tests.distributed.trainer_cases import config
from tsp_trainer.config import model_config
from tsp_trainer.model import Transformer
from tsp_trainer.model.layers import Rotary
from tsp_trainer.parallel import zigzag
from tsp_trainer.parallel.comm import CommError
from tsp_trainer.parallel.mesh import build_mesh
from tsp_trainer.parallel.schemes import parallelize

# block -> (Comm method, ledger tag) the victim stops in front of
STALL_POINTS = {"mlp": ("exchange", "mlp.weights"), "attn": ("broadcast", "attn.weights"),
                "kv": ("all_gather", "attn.kv")}


def _stop_self():
    os.kill(os.getpid(), signal.SIGSTOP)


def stall_before(comm, method: str, tag: str, out: str) -> None:
    """Make this rank stop itself when it is about to issue `method` with `tag` on `comm`."""
    original = getattr(comm, method)

    def wrapped(*args, **kwargs):
        if kwargs.get("tag") == tag:
            _stop_self_noting_pid(out)
        return original(*args, **kwargs)
    setattr(comm, method, wrapped)


def _report(out: str, rank: int, err: BaseException, waited: float, world: int) -> None:
    Path(out, f"rank_{rank}.json").write_text(json.dumps(
        {"type": type(err).__name__, "message": str(err), "waited_s": waited}))
    # Once every waiting rank has reported, end the stopped one (a scheduler would): the harness
    # then sees every process gone instead of waiting out its own deadline.
    victim = Path(out, "victim.pid")
    if len(list(Path(out).glob("rank_*.json"))) == world - 1 and victim.exists():
        os.kill(int(victim.read_text()), signal.SIGKILL)


def _stop_self_noting_pid(out: str):
    Path(out, "victim.pid").write_text(str(os.getpid()))
    _stop_self()


def stalled_block_rank(rank, world, block, victim, timeout_s, out):
    """A TSP forward of one MLP / attention block on `world` ranks (one tsp group); the mesh's
    groups get `timeout_s` (the harness's default group has a longer one)."""
    cfg = model_config("tiny", num_heads=4, num_kv_heads=4)
    mesh = build_mesh(world, timeout_s=timeout_s)
    model = Transformer(cfg)
    model.init_weights(0)
    parallelize(model, "tsp", mesh, seq_len=16)
    ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    local_ids, _, pos = zigzag.shard_batch(ids, ids, rank, world)
    x = model.embed_tokens(local_ids)
    rope = Rotary.build(pos, cfg.head_dim, cfg.rope_theta)
    if rank == victim:
        stall_before(mesh.tsp, *STALL_POINTS[block], out)
    layer = model.layers[0]
    t0 = time.monotonic()
    try:
        layer.mlp(x) if block == "mlp" else layer.self_attn(x, rope)
    except CommError as err:
        _report(out, rank, err, time.monotonic() - t0, world)
        raise
    return "no error"


def stalled_reduction_rank(rank, world, overrides, victim, at_step, out):
    """The whole Trainer (DP=2 x TSP=2); the victim stops when DeepSpeed starts the ZeRO gradient
    reduction over dp of step `at_step` (reduce_ipg_grads), after its TSP backward is done."""
    from tsp_trainer.trainer import Trainer

    trainer = Trainer(config(overrides), world_size=world, global_rank=rank)
    if rank == victim:
        zero = trainer.engine.optimizer
        reduce = zero.reduce_ipg_grads

        def stop_then_reduce(*args, **kwargs):
            if trainer.state.step + 1 == at_step:
                _stop_self_noting_pid(out)
            return reduce(*args, **kwargs)
        zero.reduce_ipg_grads = stop_then_reduce
    step_started = {}
    train_step = trainer.train_step

    def timed_step():
        step_started["t"] = time.monotonic()
        return train_step()
    trainer.train_step = timed_step
    try:
        trainer.fit()
    except CommError as err:
        _report(out, rank, err, time.monotonic() - step_started["t"], world)
        raise
    return "no error"
