"""Plain PyTorch Llama-style decoder. Knows nothing of distribution: no torch.distributed here."""

from tsp_trainer.model.layers import (Attention, GatedMLP, RMSNorm, Rotary, apply_rope,
                                      attention_core, gated_mlp, rope_cos_sin)
from tsp_trainer.model.transformer import Block, LMHead, Transformer, init_parameter

__all__ = ["Attention", "Block", "GatedMLP", "LMHead", "RMSNorm", "Rotary", "Transformer", "apply_rope",
           "attention_core", "gated_mlp", "init_parameter", "rope_cos_sin"]
