"""train.offload_activations (model/offload.py) is exact: the blocks' saved tensors go to a host
buffer and come back by copies, fetched one block ahead or on demand (train.offload_prefetch), so
TSP on 2 and 4 gloo ranks gives bit-identical loss and gradients with and without it (with and
without activation checkpointing), and matches the single-process model to the parity tolerance;
the saved tensors really leave (host bytes after the forward, none left after the backward); a
block's backward has one block input back on the device without prefetch, two with it, and under
nested checkpointing the regained inner inputs wait on the host, at the planner's host peak; the
trainer wires the option."""

from __future__ import annotations

import weakref
from dataclasses import replace

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from tests.distributed.tsp_cases import init_model, make_batch, reference
from tests.helpers.dist import run_on_ranks
from tsp_trainer.config import model_config
from tsp_trainer.model import Transformer, offload
from tsp_trainer.model.activation_checkpoint import checkpoint_pass, wrap_blocks
from tsp_trainer.model.offload import ActivationOffload
from tsp_trainer.parallel import zigzag
from tsp_trainer.parallel.loss import global_count, reduce_loss_value
from tsp_trainer.parallel.mesh import build_mesh
from tsp_trainer.parallel.schemes import parallelize
from tsp_trainer.plan.activations import activation_memory
from tsp_trainer.plan.layout import Layout
from tsp_trainer.plan.precision import FP32

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
    for name, wrapper in (("plain", inner), ("offload", ActivationOffload(inner)),
                          ("on_demand", ActivationOffload(inner, prefetch=False))):
        model.block_wrapper = wrapper
        model.zero_grad(set_to_none=True)
        loss_sum, count = model.loss_sum(local_ids, local_labels, pos)
        host_after_forward = wrapper.host_bytes if name != "plain" else 0
        total = global_count(count, [mesh.tsp])
        (loss_sum / total).backward()
        out[name] = {"loss": reduce_loss_value(loss_sum, total, [mesh.tsp]),
                     "grads": par.gather_full_grads(), "host_after_forward": host_after_forward,
                     "host_after_backward": wrapper.host_bytes if name != "plain" else 0}
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("degree,ac", [(2, False), (2, True), (4, False)])
def test_tsp_with_offload_is_bit_identical_and_matches_one_process(degree, ac):
    cfg = model_config("tiny", num_heads=8, num_kv_heads=4)
    ids, labels = make_batch(cfg, 2, 32)
    ref = reference(cfg, 7, ids, labels)
    for rank, out in enumerate(run_on_ranks(_offload_rank, degree, cfg, ids, labels, ac)):
        plain = out["plain"]
        for off in (out["offload"], out["on_demand"]):             # prefetched and fetched on demand
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


@pytest.mark.parametrize("nested", [False, True])
def test_a_second_backward_through_offloaded_tensors_is_a_clear_error(nested):
    """Also under nesting, whose regained inner inputs are used once; without the offload a
    nested segment re-runs for a second backward and gives the same gradients."""
    cfg = model_config("tiny", num_layers=3)
    ids, labels = make_batch(cfg, 1, 16)
    model = Transformer(cfg)
    init_model(model, 7)
    if nested:
        wrap_blocks(model, checkpointing=True, offload=True, segment_blocks=3)
    else:
        model.block_wrapper = ActivationOffload()
    loss = model.loss(ids, labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="offload_activations: a saved tensor was unpacked twice"):
        loss.backward()
    if nested:
        wrap_blocks(model, checkpointing=True, offload=False, segment_blocks=3)
        model.zero_grad(set_to_none=True)
        loss = model.loss(ids, labels)
        loss.backward(retain_graph=True)
        once = {n: p.grad.clone() for n, p in model.named_parameters()}
        loss.backward()
        for n, p in model.named_parameters():
            assert torch.equal(p.grad, 2 * once[n]), n          # the same values twice


class _DeviceCopies:
    """What the offload has put back on the "device" (CPU here, the same code path as CUDA's),
    sampled at every block's replay in backward: copies fetched ahead (`fetched_bytes`) plus those
    handed to a backward and still alive; and the host bytes after every copy to the host."""

    def __init__(self, off: ActivationOffload, monkeypatch):
        self.off, self.handed, self.on_device, self.host = off, [], [], [0]
        take, pack = offload._BlockStore._take, offload._BlockStore.pack

        def counted_take(store, slot):
            dev = take(store, slot)
            self.handed.append(weakref.ref(dev.untyped_storage()))
            return dev

        def counted_pack(store, t):
            packed = pack(store, t)
            self.host.append(self.off.host_bytes)
            return packed

        monkeypatch.setattr(offload._BlockStore, "_take", counted_take)
        monkeypatch.setattr(offload._BlockStore, "pack", counted_pack)

    def sample(self, *_) -> None:
        now = checkpoint_pass()
        if now is not None and now.replay:
            alive = [s() for s in self.handed]
            self.on_device.append(sum(s.nbytes() for s in alive if s is not None) + self.off.fetched_bytes)


@pytest.mark.parametrize("k,prefetch", [(1, False), (1, True), (2, False), (2, True), (3, False)])
def test_offload_holds_one_block_input_without_prefetch_and_nesting_regains_on_the_host(monkeypatch, k,
                                                                                       prefetch):
    """While each block is replayed and backpropagated, the offload has on the device its input
    only without prefetch, and the next block's too with it; under nesting the inner inputs a
    segment's re-run regains wait on the host (none on the device), whose peak is the planner's:
    the kept inputs not yet used plus the segment's regained ones (plan/activations.py)."""
    cfg = model_config("tiny", num_layers=6)
    ids, labels = make_batch(cfg, 2, 16)
    model = Transformer(cfg)
    init_model(model, 7)
    wrap_blocks(model, checkpointing=True, offload=True, segment_blocks=k, prefetch=prefetch)
    copies = _DeviceCopies(model.block_wrapper, monkeypatch)
    hooks = [b.register_forward_pre_hook(copies.sample) for b in model.layers]
    model.loss(ids, labels).backward()
    for h in hooks:
        h.remove()
    block_input = ids.numel() * cfg.hidden_size * 4                # [B, S, h] fp32
    assert len(copies.on_device) == cfg.num_layers                 # one replay per block
    assert max(copies.on_device) == (2 if prefetch else 1) * block_input
    layout = Layout("tsp", 1, micro_batch=2, activation_checkpointing=True, offload_activations=True,
                    checkpoint_segment_blocks=k, offload_prefetch=prefetch)
    act = activation_memory(cfg, layout, 16, FP32, device="cpu")
    assert act.stored_per_layer == block_input
    assert max(copies.host) == act.host                            # the host peak, regained included
    assert copies.host[cfg.num_layers // k] == -(-cfg.num_layers // k) * block_input   # after the forward
    if k > 1:                                                      # the regained ones went to the host
        assert act.host > copies.host[cfg.num_layers // k]
    assert act.phases["backward"] - activation_memory(cfg, replace(layout, offload_prefetch=True), 16, FP32,
                                                      device="cpu").phases["backward"] == \
        (0 if prefetch else -block_input)
    assert model.block_wrapper.host_bytes == 0 and model.block_wrapper.fetched_bytes == 0
