"""DeepSpeed ZeRO over the dp axis, under Hugging Face Accelerate.

Accelerate has no public way to hand DeepSpeed a model-parallel `mpu`. Measured on accelerate
1.15 / deepspeed 0.19: `Accelerator._prepare_deepspeed` looks up `deepspeed.initialize` when it
runs, so binding `mpu=` onto it for the duration of `accelerator.prepare(...)` works. That is the
one Accelerate internal we rely on; tests/distributed/test_trainer.py
(test_accelerate_internal_the_mpu_shim_relies_on) fails if it changes.

The same binding hands DeepSpeed the GPU this process uses. DeepSpeed 0.19.8's engine calls
`set_device(args.device_rank)` when `args` has that field and `set_device(LOCAL_RANK)` otherwise
(`DeepSpeedEngine._set_distributed_vars`); under one GPU per task (SLURM --gpus-per-task=1) every
process sees one device, index 0, and LOCAL_RANK >= 1 is an invalid ordinal. So on CUDA
`initialize` receives args whose device_rank is the current device (cli.py's cuda_device_index
chose it). tests/unit/test_deepspeed_device.py fails if DeepSpeed stops reading that field.

The rest of the contract with DeepSpeed: train_batch_size = micro x grad_accum x dp written
explicitly (Accelerate's "auto" would count the tsp ranks as data parallel);
gradient_clipping written explicitly (DeepSpeed's default is 1.0); a torch AdamW (no JIT build of
DeepSpeed's fused op), or with zero.offload_optimizer=cpu DeepSpeed's own DeepSpeedCPUAdam (its
ZeRO-Offload is built for it; Accelerate's swap of it is turned off, see ds_config); bf16 on GPU, fp32 on CPU, gradients accumulated and
reduced in fp32 either way; the data loader is ours, never prepared.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib
import os
import sys
import types

import torch

from tsp_trainer.config import OptimSection
from tsp_trainer.optim import adamw_hyperparameters, param_groups
from tsp_trainer.parallel.mpu import ShardedWeightsMpu, TSPMpu
from tsp_trainer.parallel.sharded_weights import GATHER_UNITS


# ZeRO-3 (schemes sp and ulysses, weights sharded over the axis x dp: parallel/mpu.py
# ShardedWeightsMpu). Every parameter is partitioned (none kept whole for being small) and released
# after each use (reuse distance 0), so each step gathers each weight once per forward use and once
# for its backward, the traffic parallel/sharded_weights.py writes in the ledger; torch's own
# F.linear stays (DeepSpeed's memory-efficient linear replaces it process-wide otherwise).
ZERO3_SETTINGS = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
                  "memory_efficient_linear": False}


def ds_config(*, micro_batch: int, grad_accum: int, dp_degree: int, zero_stage: int,
              max_grad_norm: float, bf16: bool, offload_optimizer: bool = False) -> dict:
    """Gradients are accumulated over micro-steps and reduced over dp in fp32 in every dtype:
    `data_types.grad_accum_dtype` and `communication_data_type` (DeepSpeed 0.19.8: bf16 + ZeRO-1
    then runs its BF16_Optimizer with fp32 gradient buffers, bf16 + ZeRO-2 its ZeRO optimizer with
    an fp32 gradient partition; bf16 + ZeRO-0 has no fp32 accumulation and is refused by
    config/validate.py).

    offload_optimizer: ZeRO-Offload (`zero_optimization.offload_optimizer`, pinned host memory).
    DeepSpeed 0.19.8 then runs its ZeRO optimizer at stage 1 and 2 alike (bf16 + ZeRO-1 too,
    engine.py _do_optimizer_sanity_check): the fp32 master partition, its gradient and the AdamW
    moments live on the host; under bf16 the reduced gradients still accumulate in an fp32
    partition on the device (n / dp elements) before each step copies them to the host. Under
    ZeRO-3 (stage3.py) the same keys put the fp32 master, moments and the fp32 gradient partition
    (n / world elements, reduced into on the host) there; only the weight partition stays."""
    zero = {"stage": zero_stage, "reduce_bucket_size": 5e7, "allgather_bucket_size": 5e7}
    if zero_stage == 3:
        zero.update(ZERO3_SETTINGS)
    offload = {}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        # Accelerate 1.15's _prepare_deepspeed otherwise replaces any optimizer under offload by a
        # new DeepSpeedCPUAdam (map_pytorch_optim_to_deepspeed), in Adam mode (L2 decay, not
        # AdamW's) unless the original is a torch AdamW, and the Trainer's checkpoints would read
        # the state of an optimizer nobody steps. Ours is already DeepSpeedCPUAdam, which
        # DeepSpeed's own check accepts; prepare() checks that DeepSpeed steps it.
        offload["zero_force_ds_cpu_optimizer"] = False
    return {
        **offload,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": micro_batch * grad_accum * dp_degree,
        "gradient_clipping": float(max_grad_norm),
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": bool(bf16)},
        "fp16": {"enabled": False},
        "data_types": {"grad_accum_dtype": "fp32"},
        "communication_data_type": "fp32",
        "steps_per_print": 10**12,
        "wall_clock_breakdown": False,
    }


def build_offload_optimizer(model: torch.nn.Module, cfg: OptimSection):
    """DeepSpeed's CPU AdamW for ZeRO-Offload, with the param groups and hyperparameters of
    optim.build_optimizer. Its C++ op is built on first use (engine/deepspeed.py load_cpu_adam_op)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(param_groups(model, cfg.weight_decay), **adamw_hyperparameters(cfg),
                            adamw_mode=True, bias_correction=True)


def load_cpu_adam_op():
    """JIT-build (or load from TORCH_EXTENSIONS_DIR) DeepSpeed's cpu_adam op: one g++ build of
    two C++ files against torch's headers, minutes on a busy machine. A process that builds it
    before forking ranks spares each rank the wait (tests/distributed/test_optimizer_offload.py)."""
    from deepspeed.ops.op_builder import CPUAdamBuilder

    return CPUAdamBuilder().load(verbose=False)


def skip_cpu_shm_build() -> None:
    """DeepSpeed JIT-compiles a shared-memory comm op at every initialize on CPU (~26 s the first
    time) although only inference_all_reduce uses it, which training never calls: skip the build."""
    module = importlib.import_module("deepspeed.comm.torch")
    module = sys.modules["deepspeed.comm.torch"]          # deepspeed.comm re-exports torch
    module.build_shm_op = lambda: None


def make_accelerator(ds_cfg: dict, *, timeout_s: int, cpu: bool):
    """An Accelerator carrying our DeepSpeed config. It initialises the default process group
    (gloo on CPU, NCCL on GPU) unless the caller already did."""
    os.environ.setdefault("ACCELERATE_USE_DEEPSPEED", "true")
    if cpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        skip_cpu_shm_build()
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    plugin = DeepSpeedPlugin(hf_ds_config=ds_cfg)
    kwargs = InitProcessGroupKwargs(backend="gloo" if cpu else "nccl",
                                    timeout=datetime.timedelta(seconds=timeout_s))
    return Accelerator(deepspeed_plugin=plugin, mixed_precision="bf16" if ds_cfg["bf16"]["enabled"] else "no",
                       kwargs_handlers=[kwargs])


def device_args(device_index: int | None):
    """The `args` DeepSpeed's engine reads its device from: device_rank = the CUDA device index
    this process uses; None (DeepSpeed's default, LOCAL_RANK) off CUDA."""
    return None if device_index is None else types.SimpleNamespace(device_rank=device_index)


@contextlib.contextmanager
def bound_to_initialize(mpu: TSPMpu, device_index: int | None):
    """Inside the block, deepspeed.initialize(...) receives mpu=mpu (the shim) and args naming
    the CUDA device `device_index` (None: no args, as off CUDA)."""
    import deepspeed

    original = deepspeed.initialize
    deepspeed.initialize = functools.partial(original, mpu=mpu, args=device_args(device_index))
    try:
        yield
    finally:
        deepspeed.initialize = original


def mark_gather_units(model: torch.nn.Module) -> None:
    """ZeRO-3: the attention and MLP modules read their holders' weights without calling them, so
    DeepSpeed gathers all parameters under each of them at its call (its "leaf" modules,
    parallel/sharded_weights.py GATHER_UNITS). Before deepspeed.initialize."""
    from deepspeed.utils import set_z3_leaf_modules

    set_z3_leaf_modules(model, list(GATHER_UNITS), raise_if_not_found=False)


def prepare(accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            mpu: TSPMpu | ShardedWeightsMpu):
    """accelerator.prepare(model, optimizer) with our mpu -> (DeepSpeedEngine, optimizer)."""
    if isinstance(mpu, ShardedWeightsMpu):
        mark_gather_units(model)
    device_index = torch.cuda.current_device() if accelerator.device.type == "cuda" else None
    with bound_to_initialize(mpu, device_index):
        engine, opt = accelerator.prepare(model, optimizer)
    if engine.basic_optimizer is not optimizer:
        raise RuntimeError(f"DeepSpeed steps a {type(engine.basic_optimizer).__name__}, not the "
                           f"{type(optimizer).__name__} handed to accelerator.prepare: Accelerate "
                           "replaced it (has _prepare_deepspeed changed?)")
    expected = mpu.get_data_parallel_world_size()
    if engine.dp_world_size != expected:
        raise RuntimeError(f"DeepSpeed engine sees dp_world_size={engine.dp_world_size}, expected "
                           f"{expected}: the mpu did not reach deepspeed.initialize (has "
                           "Accelerate's _prepare_deepspeed changed?)")
    return engine, opt


def sharded_weights_engine(model: torch.nn.Module, optimizer: torch.optim.Optimizer, mesh, *,
                           micro_batch: int, bf16: bool):
    """deepspeed.initialize straight (no Accelerate) with ZeRO-3 over every rank of `mesh`
    (ShardedWeightsMpu), the trainer's ds_config and no gradient clipping -> the DeepSpeedEngine.
    tsp-bench runs `sp` and `ulysses` through it as the trainer runs them (zero.stage auto = 3).
    `model`: parallelized with sharded_weights, whole parameters (ZeRO-3 partitions them here)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        skip_cpu_shm_build()
    import deepspeed

    mark_gather_units(model)
    cfg = ds_config(micro_batch=micro_batch, grad_accum=1, dp_degree=mesh.world.size, zero_stage=3,
                    max_grad_norm=0.0, bf16=bf16)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg,
                                      mpu=ShardedWeightsMpu(mesh), dist_init_required=False)
    return engine
