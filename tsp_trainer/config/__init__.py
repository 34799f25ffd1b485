"""Typed configuration: frozen dataclasses (schema), OmegaConf loading (load), cross-field rules
(validate). Imports only the standard library (load.py imports omegaconf lazily)."""

from tsp_trainer.config.load import config_to_yaml, load_config, save_resolved_config
from tsp_trainer.config.model import MODEL_SIZES, ModelConfig, model_config
from tsp_trainer.config.resolve import resolve_config, run_facts
from tsp_trainer.config.schema import (CheckpointSection, DataSection, LoggingSection, ModelSection,
                                       OptimSection, ParallelSection, TrainConfig, TrainSection,
                                       ZeroSection)
from tsp_trainer.config.validate import (check_parallel_shapes, hang_dump_after_s, resolve_dp_degree,
                                         validate_config)

__all__ = ["MODEL_SIZES", "CheckpointSection", "DataSection", "LoggingSection", "ModelConfig",
           "ModelSection", "OptimSection", "ParallelSection", "TrainConfig", "TrainSection",
           "ZeroSection", "check_parallel_shapes", "config_to_yaml", "hang_dump_after_s", "load_config",
           "model_config", "resolve_config", "resolve_dp_degree", "run_facts", "save_resolved_config",
           "validate_config"]
