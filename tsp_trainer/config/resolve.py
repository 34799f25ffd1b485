"""The config as a run uses it: `resolve_config` fills what the recipe left to be derived (the model
dims of a named size, `train.dtype: auto`, `parallel.dp_degree`), so that the config the run writes
(config.yaml, checkpoint meta) and logs (W&B) says what actually ran. Pure: standard library only."""

from __future__ import annotations

import dataclasses

from tsp_trainer.config.schema import ModelSection, TrainConfig, resolved_dtype, resolved_zero_stage


def resolve_config(cfg: TrainConfig, *, world_size: int, cuda: bool) -> TrainConfig:
    """`cfg` with every model dim explicit, dtype "auto" resolved (bf16 on GPU, fp32 on CPU),
    zero.stage "auto" resolved (schema.resolved_zero_stage) and
    dp_degree = world_size / tsp_degree. load_config reads the written YAML back to an equal config."""
    model = cfg.model.to_model_config()
    # Scalar shape keys only: the sources (size, init_from, config_from), the seed and nested
    # sections (rope_scaling) stay as written; an explicit key equal to its source's value agrees.
    dims = {f.name: getattr(model, f.name) for f in dataclasses.fields(ModelSection)
            if hasattr(model, f.name) and f.name not in ("seed", "size", "init_from", "config_from")
            and not dataclasses.is_dataclass(getattr(cfg.model, f.name))}
    dtype = resolved_dtype(cfg.train.dtype, cuda)
    return dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, **dims),
        train=dataclasses.replace(cfg.train, dtype=dtype),
        zero=dataclasses.replace(cfg.zero, stage=resolved_zero_stage(cfg.zero.stage, cfg.parallel.scheme)),
        parallel=dataclasses.replace(cfg.parallel, dp_degree=world_size // cfg.parallel.tsp_degree))


def run_facts(cfg: TrainConfig, *, world_size: int, device: str, peak_tflops: float | None) -> dict:
    """What the W&B config carries beside the resolved config: the mesh and the device."""
    return {"world_size": world_size, "dp_degree": world_size // cfg.parallel.tsp_degree,
            "tsp_degree": cfg.parallel.tsp_degree, "device": device, "peak_tflops": peak_tflops}
