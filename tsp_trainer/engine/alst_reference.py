"""The unmodified ALST stack (DeepSpeed Ulysses for Hugging Face models + ZeRO-3), the reference
tsp-bench runs beside our `ulysses` scheme (tsp_trainer/bench/alst.py builds the model and the
batch; this module holds every DeepSpeed call, the one package allowed to import it).

What it takes on CPU with gloo (DeepSpeed 0.19.8):
- `UlyssesSPAttentionHF.register_with_transformers` replaces the attention function of the core
  implementation ("sdpa") in transformers' ALL_ATTENTION_FUNCTIONS for the whole process: run it in
  processes of its own (tsp-bench launches them apart from our schemes');
- the returned mpu handed to `deepspeed.initialize(..., mpu=mpu)` with
  `"sequence_parallel_size": world` in the config, so ZeRO-3 shards the weights over the ranks;
- each rank fed its contiguous slice of input_ids with the full sequence's position_ids (what
  `UlyssesSPDataLoaderAdapter` hands each rank; the adapter itself also shifts the labels, which
  the bench's batch already is).
"""

from __future__ import annotations

import os

import torch


def register_ulysses(hf_model, *, world: int, micro_batch: int, seq_len: int):
    """Patch transformers' "sdpa" attention with DeepSpeed's Ulysses over `world` ranks (this
    process only, once) -> DeepSpeed's sequence-parallel mpu."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    from tsp_trainer.engine.deepspeed import skip_cpu_shm_build

    if not torch.cuda.is_available():
        skip_cpu_shm_build()
    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), auto_mpi_discovery=False,
                                   verbose=False)
    return UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=hf_model, core_attn_implementation="sdpa", sequence_parallel_size=world,
        micro_batch_size=micro_batch, seq_length=seq_len, seq_length_is_variable=False)


def zero3_engine(hf_model, mpu, *, world: int, micro_batch: int, lr: float, bf16: bool):
    """deepspeed.initialize with ZeRO-3 over the sequence-parallel ranks and torch AdamW (no JIT
    op build) -> the DeepSpeedEngine. Bucket sizes are those transformers' Trainer gives ZeRO-3's
    "auto" (h^2 elements per reduce bucket, 0.9 h^2 prefetched, parameters under 10 h elements kept
    whole), so the buffers scale with the model as in ALST's runs."""
    import deepspeed

    h = hf_model.config.hidden_size
    zero = {"stage": 3, "reduce_bucket_size": h * h, "stage3_prefetch_bucket_size": int(0.9 * h * h),
            "stage3_param_persistence_threshold": 10 * h}
    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
              "sequence_parallel_size": world, "zero_optimization": zero,
              "zero_allow_untested_optimizer": True, "bf16": {"enabled": bf16}, "fp16": {"enabled": False},
              "steps_per_print": 10**12, "wall_clock_breakdown": False}
    optimizer = torch.optim.AdamW(hf_model.parameters(), lr=lr)
    engine, *_ = deepspeed.initialize(model=hf_model, optimizer=optimizer, config=config, mpu=mpu,
                                      dist_init_required=False)
    return engine


def zero3_state(engine) -> dict[str, list[torch.Tensor]]:
    """The tensors ZeRO-3 holds between steps on this rank: the parameters' partitions
    (`ds_tensor`) and persistent whole parameters, the fp32 master partitions, the gradient
    partitions' flat buffer and the reduce buckets (`contiguous_gradients`: reduce_bucket_size
    elements per gradient dtype, allocated at start-up), and the optimizer's moments (once it has
    stepped)."""
    params = [getattr(p, "ds_tensor", p.data) for p in engine.module.parameters()]
    params += [p.data for p in engine.module.parameters() if p.data.numel()]
    opt = engine.optimizer
    masters = list(getattr(opt, "fp32_partitioned_groups_flat", []))
    grads = [g for g in (getattr(opt, "grad_partitions_flat_buffer", None),) if g is not None]
    grads += zero3_reduce_buckets(engine)
    inner = getattr(opt, "optimizer", opt)
    moments = [v for s in inner.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"param": params + masters, "grad": grads, "optim": moments}


def zero3_reduce_buckets(engine) -> list[torch.Tensor]:
    """ZeRO-3's reduce buckets (reduce_bucket_size elements per gradient dtype) on this rank."""
    buckets = getattr(engine.optimizer, "ipg_buckets", {}).values()
    return [b.buffer for b in buckets if getattr(b, "buffer", None) is not None]


def zero3_state_bytes(engine) -> dict[str, int]:
    """zero3_state's bytes (distinct storages) as param_bytes, grad_bytes, optim_bytes."""
    from tsp_trainer.tools.memory import tensor_bytes

    return {f"{k}_bytes": tensor_bytes(v) for k, v in zero3_state(engine).items()}
