"""The decoder: embedding -> N x (norm, attention, residual, norm, gated MLP, residual) -> norm ->
LM head + cross-entropy. Module names match Hugging Face's LlamaForCausalLM state dict
(model.embed_tokens, model.layers.i.self_attn.q_proj, ...), minus the leading "model."."""

from __future__ import annotations

import hashlib
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from tsp_trainer.config import ModelConfig
from tsp_trainer.model.layers import Attention, GatedMLP, PositionRuns, RMSNorm, Rotary

IGNORE_INDEX = -100


class TokenStats(NamedTuple):
    """Per-token results of a forward pass without gradients (evaluation), in the layout of the
    tokens given: loss [B, T] fp32 cross-entropy (0 where the label is ignored) and argmax [B, T]
    int64, the most likely next token (the first index on ties, as torch.argmax)."""

    loss: torch.Tensor
    argmax: torch.Tensor


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = GatedMLP(cfg)

    def forward(self, x: torch.Tensor, rope: Rotary) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class BlockSegment:
    """Consecutive blocks run as one unit (Transformer.blocks_per_call). Not a module: the blocks
    stay registered where they are (layers.i), so state dicts do not change."""

    def __init__(self, blocks: list[Block]):
        self.blocks = tuple(blocks)

    def __len__(self) -> int:
        return len(self.blocks)

    def __call__(self, x: torch.Tensor, rope: Rotary, each=None) -> torch.Tensor:
        """The blocks in order; `each`: a block_wrapper(block, x, rope) around every block's call."""
        for block in self.blocks:
            x = block(x, rope) if each is None else each(block, x, rope)
        return x


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class LMHead(nn.Module):
    """Output projection and the loss. `loss_sum` returns (sum of token losses, valid-token count),
    so that callers can divide by a global count (the mean over all tokens of the global batch)."""

    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)

    def loss_sum(self, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self(hidden).float()
        loss = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="sum",
                               ignore_index=IGNORE_INDEX)
        return loss, (labels != IGNORE_INDEX).sum()

    @torch.no_grad()
    def token_stats(self, hidden: torch.Tensor, labels: torch.Tensor) -> TokenStats:
        logits = self(hidden).float()                                    # [B, T, V]
        loss = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="none",
                               ignore_index=IGNORE_INDEX).view(labels.shape)
        return TokenStats(loss, logits.argmax(dim=-1))


class Transformer(nn.Module):
    """`attention_kernel`: the run's train.attention_kernel choice (model/attention_kernel.py), and
    `attention_gqa` its train.attention_gqa (model/attention_route.py GQA_PATHS), handed to every
    attention call through the pass's Rotary."""

    def __init__(self, cfg: ModelConfig, *, attention_kernel: str = "fa2", attention_gqa: str = "native"):
        super().__init__()
        self.cfg, self.attention_kernel, self.attention_gqa = cfg, attention_kernel, attention_gqa
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Wraps each call of blocks (e.g. activation checkpointing); set by the trainer, not the model.
        self.block_wrapper = None
        # Consecutive blocks per call of block_wrapper: 1 hands it each Block; k > 1 a BlockSegment
        # of k blocks (the last one may be shorter), e.g. for nested checkpointing. Set with it.
        self.blocks_per_call = 1
        self._segments: tuple[tuple, tuple[BlockSegment, ...]] = ((), ())

    # -- forward ---------------------------------------------------------------------------------
    def hidden_states(self, input_ids: torch.Tensor,
                      positions: PositionRuns | torch.Tensor | None = None) -> torch.Tensor:
        """Final normed hidden states [B, T, h]. positions: global token positions of the given
        tokens (default 0..T-1), as PositionRuns (host ints: no device read) or a tensor [T]; a
        sequence-parallel caller passes the positions of its slice."""
        if positions is None:
            positions = PositionRuns.contiguous(input_ids.shape[1])
        rope = Rotary.for_model(positions, self.cfg, device=input_ids.device,
                                attention_kernel=self.attention_kernel, attention_gqa=self.attention_gqa)
        x = self.embed_tokens(input_ids)
        for unit in self.block_units():
            x = unit(x, rope) if self.block_wrapper is None else self.block_wrapper(unit, x, rope)
        return self.norm(x)

    def block_units(self):
        """What one call of block_wrapper runs, in order: the blocks themselves (blocks_per_call
        1), or BlockSegments of blocks_per_call consecutive blocks, the same objects from call to
        call (a wrapper may key its state by them)."""
        k = self.blocks_per_call
        if k == 1:
            return self.layers
        blocks = tuple(self.layers)
        if self._segments[0] != (k, blocks):     # built once per k (and per set of blocks)
            self._segments = ((k, blocks), tuple(BlockSegment(list(blocks[i:i + k]))
                                                 for i in range(0, len(blocks), k)))
        return self._segments[1]

    def forward(self, input_ids: torch.Tensor,
                positions: PositionRuns | torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, vocab]."""
        return self.lm_head(self.hidden_states(input_ids, positions))

    def loss_sum(self, input_ids: torch.Tensor, labels: torch.Tensor,
                 positions: PositionRuns | torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of token cross-entropies, number of labels != -100) for these tokens."""
        return self.lm_head.loss_sum(self.hidden_states(input_ids, positions), labels)

    @torch.no_grad()
    def token_stats(self, input_ids: torch.Tensor, labels: torch.Tensor,
                    positions: torch.Tensor | None = None) -> TokenStats:
        """Per-token loss and argmax of these tokens (forward only; the LM head decides how the
        vocabulary is reduced: a parallel head never holds full logits of all tokens)."""
        return self.lm_head.token_stats(self.hidden_states(input_ids, positions), labels)

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over valid labels (single-process reference)."""
        total, count = self.loss_sum(input_ids, labels)
        return total / count.clamp(min=1)

    # -- init ------------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic init from one seed, per parameter name, independent of layout: every
        parallel scheme that builds its shards with `init_parameter` gets slices of these tensors."""
        for name, param in self.named_parameters():
            param.copy_(init_parameter(name, tuple(param.shape), seed=seed, std=self.cfg.init_std))


def init_parameter(name: str, shape: tuple[int, ...], *, seed: int, std: float) -> torch.Tensor:
    """The full initial value of parameter `name`: ones for norms, zeros for biases (as transformers
    initialises them), N(0, std) otherwise, drawn from a generator seeded by (seed, name) so the
    value does not depend on the order of construction. On the host by design (a CPU generator
    gives the same values everywhere); the caller moves its slice to the compute device."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, device="cpu")
    if name.endswith(".bias"):
        return torch.zeros(shape, device="cpu")
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return torch.empty(shape, device="cpu").normal_(0.0, std, generator=gen)
