"""Typed configuration: frozen dataclasses (schema), OmegaConf loading (load), cross-field rules
(validate). Imports only the standard library (load.py imports omegaconf lazily)."""

from tsp_trainer.config.model import MODEL_SIZES, ModelConfig, model_config

__all__ = ["MODEL_SIZES", "ModelConfig", "model_config"]
