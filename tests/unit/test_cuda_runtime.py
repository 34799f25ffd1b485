"""The pieces of the CUDA path that are pure decisions, checked without a GPU: the device guard of
every collective, which GPU a process takes, the allocator setting, whose CUDA RNG state a
process restores."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.devices import HostDefaultElsewhere
from tsp_trainer.cli import DEFAULT_CUDA_ALLOC_CONF, cuda_device_index, default_allocator_env
from tsp_trainer.config.model import RopeScaling
from tsp_trainer.model.rope import PositionRuns, rope_cos_sin
from tsp_trainer.parallel.comm import Comm, WrongDeviceError
from tsp_trainer.parallel.ledger import CommLedger
from tsp_trainer.checkpoint.train_state import cuda_rng_state_for_this_device


def _comm(size: int, device: str) -> Comm:
    # No process group: the guard runs before any backend call.
    return Comm(None, list(range(size)), 0, CommLedger(), "tsp", device=device)


@pytest.mark.parametrize("size", [1, 2])
def test_every_collective_refuses_a_tensor_off_the_compute_device_and_names_the_op(size):
    comm = _comm(size, "cuda:0")                     # the run computes on a GPU
    host = torch.zeros(4)                            # a stray host tensor
    calls = {
        "broadcast": lambda: comm.broadcast(host, 0, tag="x"),
        "all_gather": lambda: comm.all_gather(torch.zeros(4 * size), host, tag="x"),
        "reduce_scatter": lambda: comm.reduce_scatter(host, torch.zeros(4 * size), tag="x"),
        "reduce": lambda: comm.reduce(host, 0, tag="x"),
        "all_reduce": lambda: comm.all_reduce(host, tag="x"),
        "send/recv": lambda: comm.exchange(host, torch.zeros(4), send_to=0, recv_from=0, tag="x"),
    }
    for op, call in calls.items():
        with pytest.raises(WrongDeviceError, match=rf"^{op} of 'x' on axis 'tsp': tensor 0 \(\d+,\) "
                                                   r"torch.float32 is on cpu, but this run computes on cuda:0"):
            call()
    assert comm.ledger.records == []                 # refused before anything was recorded or sent


def test_guard_accepts_the_compute_device():
    comm = _comm(1, "cpu")
    t = torch.ones(3)
    comm.all_reduce(t, tag="x")                      # size 1: a local no-op, after the check
    with pytest.raises(WrongDeviceError, match="is on meta"):
        comm.all_reduce(torch.ones(3, device="meta"), tag="x")


@pytest.mark.parametrize("local_rank,visible,local_world,expected", [
    (3, 1, 8, 0),          # one GPU per task (CUDA_VISIBLE_DEVICES=<its GPU>): always index 0
    (0, 1, None, 0),
    (3, 8, 8, 3),          # torchrun: every process sees the node's GPUs
    (3, 8, None, 3),
])
def test_cuda_device_index(local_rank, visible, local_world, expected):
    assert cuda_device_index(local_rank, visible, local_world) == expected


def test_cuda_device_index_refuses_what_it_cannot_map():
    with pytest.raises(ValueError, match=r"LOCAL_RANK=5 with 4 visible GPUs and LOCAL_WORLD_SIZE=8"):
        cuda_device_index(5, 4, 8)
    with pytest.raises(ValueError, match=r"LOCAL_RANK=1 with 2 visible GPUs and LOCAL_WORLD_SIZE=4"):
        cuda_device_index(1, 2, 4)       # 2 GPUs each for 4 processes: ambiguous, refused
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        cuda_device_index(0, 0, 1)


def test_expandable_segments_by_default_and_the_users_setting_kept():
    assert default_allocator_env({}) == {"PYTORCH_CUDA_ALLOC_CONF": DEFAULT_CUDA_ALLOC_CONF}
    assert DEFAULT_CUDA_ALLOC_CONF == "expandable_segments:True"
    assert default_allocator_env({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}) == {}
    assert default_allocator_env({"PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync"}) == {}


def test_cuda_rng_state_restored_for_this_device_only():
    state = torch.ByteTensor([1, 2, 3])
    assert cuda_rng_state_for_this_device(state, 0) is state        # saved for one device
    assert cuda_rng_state_for_this_device(state, None) is None      # no GPU here
    assert cuda_rng_state_for_this_device(None, 0) is None
    per_device = [torch.ByteTensor([0]), torch.ByteTensor([1])]     # older checkpoints: all GPUs
    assert cuda_rng_state_for_this_device(per_device, 1) is per_device[1]
    assert cuda_rng_state_for_this_device(per_device, 5) is None


@pytest.mark.parametrize("scaling", [
    None, RopeScaling("linear", factor=4.0),
    RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=64),
    RopeScaling("yarn", factor=4.0, original_max_position_embeddings=64)],
    ids=["default", "linear", "llama3", "yarn"])
def test_rope_tables_are_built_on_the_positions_device(scaling):
    """Every RoPE type builds its frequencies on the compute device: a host tensor there would be
    a blocking host-to-device copy per forward on a GPU (and a stray host tensor). Host-default
    factories of the model package land on the meta device here (tests/helpers/devices.py), so a
    table built from one fails; the values equal those built without the redirection."""
    positions = PositionRuns(((0, 16), (48, 16))).tensor()
    expected = rope_cos_sin(positions, 64, 10000.0, scaling)
    with HostDefaultElsewhere(packages=("tsp_trainer.model",)) as mode:
        got = rope_cos_sin(positions, 64, 10000.0, scaling)
    assert mode.redirected == []
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
