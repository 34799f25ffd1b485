"""DeepSpeed's engine is told which GPU this process uses: under one GPU per task (one visible
device) it must ask for device 0 whatever LOCAL_RANK is. Runs DeepSpeed's own set-up methods on
CPU, with CUDA's device calls replaced by recorders."""

import functools
import types

import pytest
import torch

import deepspeed
import deepspeed.comm
from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator
from deepspeed.runtime import engine as ds_engine_module
from deepspeed.runtime.engine import DeepSpeedEngine

from tsp_trainer.engine import deepspeed as ds_engine


@pytest.fixture
def one_visible_gpu(monkeypatch):
    """LOCAL_RANK=3 on a process that sees one GPU; returns the devices set_device was asked for."""
    asked: list[int] = []
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.delenv("OMPI_COMM_WORLD_LOCAL_RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", asked.append)
    monkeypatch.setattr(ds_engine_module, "get_accelerator", CUDA_Accelerator)
    monkeypatch.setattr(deepspeed.comm, "get_world_size", lambda *a, **k: 4)
    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda *a, **k: 3)
    return asked


def _engine_device_setup(args) -> types.SimpleNamespace:
    """The part of DeepSpeedEngine.__init__ that reads the local rank and sets the device, run on
    a bare object (0.19.8: _do_args_sanity_check, _configure_with_arguments, _set_distributed_vars)."""
    engine = types.SimpleNamespace()
    DeepSpeedEngine._do_args_sanity_check(engine, args)
    DeepSpeedEngine._configure_with_arguments(engine, args, None)
    DeepSpeedEngine._set_distributed_vars(engine, args)
    return engine


def test_engine_asks_for_the_visible_gpu_not_local_rank(one_visible_gpu):
    engine = _engine_device_setup(ds_engine.device_args(torch.cuda.current_device()))
    assert one_visible_gpu == [0]
    assert engine.device == torch.device("cuda", 0)
    assert engine.local_rank == 3                   # LOCAL_RANK itself is left as the launcher set it


def test_deepspeed_internal_the_device_fix_relies_on(one_visible_gpu):
    """Without args DeepSpeed asks for LOCAL_RANK (the invalid ordinal under one GPU per task), and
    args.device_rank overrides it: if either changes, engine/deepspeed.py's device_args must too."""
    _engine_device_setup(None)
    _engine_device_setup(types.SimpleNamespace(device_rank=1))
    assert one_visible_gpu == [3, 1]


def test_prepare_hands_initialize_the_current_device(monkeypatch):
    """prepare() binds mpu= and args= (device_rank = torch.cuda.current_device()) onto
    deepspeed.initialize while accelerator.prepare runs, and off CUDA passes no args."""
    seen = []
    mpu = types.SimpleNamespace(get_data_parallel_world_size=lambda: 2)

    class FakeAccelerator:
        def __init__(self, device):
            self.device = torch.device(device)

        def prepare(self, model, optimizer):
            seen.append(deepspeed.initialize.keywords)
            return types.SimpleNamespace(dp_world_size=2, basic_optimizer=optimizer), optimizer

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    ds_engine.prepare(FakeAccelerator("cuda:0"), torch.nn.Linear(1, 1), None, mpu)
    ds_engine.prepare(FakeAccelerator("cpu"), torch.nn.Linear(1, 1), None, mpu)
    assert seen[0]["mpu"] is mpu and seen[0]["args"].device_rank == 0
    assert seen[1]["mpu"] is mpu and seen[1]["args"] is None
    assert not isinstance(deepspeed.initialize, functools.partial)      # unbound afterwards


def test_prepare_refuses_an_optimizer_accelerate_replaced():
    """Under optimizer offload Accelerate may swap the optimizer for its own DeepSpeedCPUAdam
    (engine/deepspeed.py ds_config): prepare() stops when DeepSpeed steps another object."""
    mpu = types.SimpleNamespace(get_data_parallel_world_size=lambda: 1)

    class SwappingAccelerator:
        device = torch.device("cpu")

        def prepare(self, model, optimizer):
            return types.SimpleNamespace(dp_world_size=1, basic_optimizer=object()), optimizer

    with pytest.raises(RuntimeError, match="Accelerate replaced it"):
        ds_engine.prepare(SwappingAccelerator(), torch.nn.Linear(1, 1), torch.optim.SGD(
            torch.nn.Linear(1, 1).parameters(), lr=0.1), mpu)
