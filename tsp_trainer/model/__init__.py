"""Plain PyTorch Llama-style decoder. Knows nothing of distribution: no torch.distributed here."""

from tsp_trainer.model.layers import Attention, GatedMLP, RMSNorm, attention_core, gated_mlp
from tsp_trainer.model.rope import Rotary, apply_rope, rope_cos_sin, rope_frequencies
from tsp_trainer.model.transformer import Block, LMHead, TokenStats, Transformer, init_parameter

__all__ = ["Attention", "Block", "GatedMLP", "LMHead", "RMSNorm", "Rotary", "TokenStats", "Transformer", "apply_rope",
           "attention_core", "gated_mlp", "init_parameter", "rope_cos_sin",
           "rope_frequencies"]
