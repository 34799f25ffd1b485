"""What this device and dtype cannot run, refused before any process group starts, each refusal
naming the shape and dtype: DeepSpeed's precision rule, the CUDA attention route for the model's
heads, and the routes parallel.tsp_recompute=selective / none accept."""

from __future__ import annotations

import torch

from tsp_trainer.config import ModelConfig, TrainConfig
from tsp_trainer.config.validate import check_precision
from tsp_trainer.model.attention_route import check_cuda_attention
from tsp_trainer.parallel.tsp.recompute_rules import check_selective_route


def check_device_support(cfg: TrainConfig, model_cfg: ModelConfig, *, device: torch.device,
                         attention_kernel: str = "fa2") -> None:
    """Raises ValueError for what `device` cannot run under `cfg` (train.dtype already resolved)
    with the run's `attention_kernel` (train.attention_gqa refuses nothing: both GQA paths take
    what the flash route takes)."""
    bf16 = cfg.train.dtype == "bf16"
    check_precision(zero_stage=cfg.zero.stage, bf16=bf16)
    if device.type != "cuda":
        return
    m = model_cfg
    route = check_cuda_attention(num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                                 dtype=torch.bfloat16 if bf16 else torch.float32, kernel=attention_kernel)
    # selective and none keep the attention kernel's graph alike (none adds the MLP's)
    if cfg.parallel.tsp_recompute != "full":
        check_selective_route(route, dtype=cfg.train.dtype, num_heads=m.num_heads,
                              num_kv_heads=m.num_kv_heads, document_masking=cfg.data.document_masking,
                              mode=cfg.parallel.tsp_recompute)


def device_refusal(device: torch.device):
    """`refuses(cfg)` for the `auto` resolution on `device`: raises what check_device_support
    raises for a candidate config, with the attention kernel that config would run."""
    from tsp_trainer.model.attention_kernel import run_attention_kernel

    def refuses(cfg: TrainConfig) -> None:
        model_cfg = cfg.model.to_model_config()
        kernel = run_attention_kernel(cfg, model_cfg, device=device).kernel
        check_device_support(cfg, model_cfg, device=device, attention_kernel=kernel)
    return refuses
