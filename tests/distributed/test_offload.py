"""train.offload_activations (model/offload.py) is exact: the blocks' saved tensors go to a host
buffer and come back by copies, so TSP on 2 and 4 gloo ranks gives bit-identical loss and gradients
with and without it (with and without activation checkpointing), and matches the single-process
model to the parity tolerance; the saved tensors really leave (host bytes after the forward, none
left after the backward); the trainer wires the option."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from tests.distributed.tsp_cases import init_model, make_batch, reference
from tests.helpers.dist import run_on_ranks
from tsp_trainer.config import model_config
from tsp_trainer.model import Transformer
from tsp_trainer.model.offload import ActivationOffload
from tsp_trainer.parallel import zigzag
from tsp_trainer.parallel.loss import global_count, reduce_loss_value
from tsp_trainer.parallel.mesh import build_mesh
from tsp_trainer.parallel.schemes import parallelize

RTOL, ATOL = 1e-5, 1e-6


def _checkpointed(block, x, rope):
    return checkpoint(block, x, rope, use_reentrant=False)


def _offload_rank(rank, world, cfg, ids, labels, ac):
    mesh = build_mesh(world)
    model = Transformer(cfg)
    init_model(model, 7)
    par = parallelize(model, "tsp", mesh, seq_len=ids.shape[1])
    local_ids, local_labels, pos = zigzag.shard_batch(ids, labels, mesh.tsp_rank, mesh.dims.tsp)
    inner = _checkpointed if ac else None
    out = {}
    for name, wrapper in (("plain", inner), ("offload", ActivationOffload(inner))):
        model.block_wrapper = wrapper
        model.zero_grad(set_to_none=True)
        loss_sum, count = model.loss_sum(local_ids, local_labels, pos)
        host_after_forward = wrapper.host_bytes if name == "offload" else 0
        total = global_count(count, [mesh.tsp])
        (loss_sum / total).backward()
        out[name] = {"loss": reduce_loss_value(loss_sum, total, [mesh.tsp]),
                     "grads": par.gather_full_grads(), "host_after_forward": host_after_forward,
                     "host_after_backward": wrapper.host_bytes if name == "offload" else 0}
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("degree,ac", [(2, False), (2, True), (4, False)])
def test_tsp_with_offload_is_bit_identical_and_matches_one_process(degree, ac):
    cfg = model_config("tiny", num_heads=8, num_kv_heads=4)
    ids, labels = make_batch(cfg, 2, 32)
    ref = reference(cfg, 7, ids, labels)
    for rank, out in enumerate(run_on_ranks(_offload_rank, degree, cfg, ids, labels, ac)):
        plain, off = out["plain"], out["offload"]
        assert off["loss"] == plain["loss"], f"rank {rank}"
        for name, g in plain["grads"].items():
            assert torch.equal(off["grads"][name], g), f"rank {rank} grad {name}"
            torch.testing.assert_close(off["grads"][name], ref["grads"][name], rtol=RTOL, atol=ATOL)
        assert off["loss"] == pytest.approx(ref["loss"], rel=RTOL, abs=ATOL)
        # every block's saved tensors were in the host buffer after the forward, none after backward
        n_local = ids.numel() // degree
        assert off["host_after_forward"] >= cfg.num_layers * n_local * cfg.hidden_size * 4
        assert off["host_after_backward"] == 0


def test_offload_moves_saved_tensors_but_not_parameters():
    cfg = model_config("tiny")
    ids, labels = make_batch(cfg, 1, 16)
    model = Transformer(cfg)
    init_model(model, 7)
    off = ActivationOffload()
    model.block_wrapper = off
    loss = model.loss(ids, labels)
    stores = [off._stores[i] for i in range(cfg.num_layers)]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert all(s.host for s in stores)
    assert not any(t.untyped_storage().data_ptr() in params for s in stores for t in s.host)
    loss.backward()
    assert off.host_bytes == 0
    with torch.no_grad():                          # no graph, no hooks: nothing offloaded
        model.loss(ids, labels)
    assert off.host_bytes == 0


def test_a_second_backward_through_offloaded_tensors_is_a_clear_error():
    cfg = model_config("tiny")
    ids, labels = make_batch(cfg, 1, 16)
    model = Transformer(cfg)
    model.block_wrapper = ActivationOffload()
    loss = model.loss(ids, labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="offload_activations: a saved tensor was unpacked twice"):
        loss.backward()
