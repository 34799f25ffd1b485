"""Turn the plain Transformer into its parallel form, from a plan table.

`apply_tsp(model, comm)` swaps every block for its TSP implementation (tsp/), keeping parameter
names, and returns the ShardingSpec of every parameter (which dim is split over which axis), the
record checkpointing and export use to gather, reshard or slice state dicts.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import typing
from dataclasses import dataclass

import torch
import torch.nn as nn

from tsp_trainer.config.schema import ReplayKeeps
from tsp_trainer.config.validate import check_parallel_shapes
from tsp_trainer.model.transformer import Transformer, init_parameter
from tsp_trainer.parallel.comm import Comm
from tsp_trainer.parallel.gated_mlp import TokenTiling
from tsp_trainer.parallel.grad_sync import KV_GRAD_TAG, ReplicatedGrads
from tsp_trainer.parallel.tsp.attention import TSPAttention
from tsp_trainer.parallel.tsp.mlp import TSPGatedMLP
from tsp_trainer.parallel.tsp.norm import TSPRMSNorm
from tsp_trainer.parallel.tsp.vocab import TSPEmbedding, TSPLMHead


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter is laid out: split along `dim` into `degree` equal blocks over mesh axis
    `axis` (block i on the axis's rank i), or replicated when dim is None. `size`: the full length
    along `dim` when it is not a multiple of the degree (the vocabulary rows): the full tensor is
    padded with zero rows to the next multiple before it is split, and the padding is cut off
    again when the blocks are put back together (`trim`). `repeat`: how many consecutive ranks of
    the axis hold each block (K/V heads fewer than the degree: degree = n_kv blocks, each a copy
    on D / n_kv ranks, whose gradients are summed over them); rank i holds block i // repeat."""

    dim: int | None
    degree: int = 1
    axis: str = "tsp"
    size: int | None = None
    repeat: int = 1

    def block(self, rank: int) -> int:
        """The block a rank of the axis holds."""
        return rank // self.repeat

    def local(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        if self.dim is None:
            return full
        rank = self.block(rank)
        pad = -full.shape[self.dim] % self.degree
        if pad:
            shape = list(full.shape)
            shape[self.dim] = pad
            full = torch.cat([full, full.new_zeros(shape)], dim=self.dim)
        return full.chunk(self.degree, dim=self.dim)[rank].clone()

    def trim(self, full: torch.Tensor) -> torch.Tensor:
        """The blocks put back together [padded, ...] -> the tensor's own length along dim."""
        return full if self.size is None else full.narrow(self.dim, 0, self.size)


# FQN pattern -> split dim, for TSP (and TP, which shards weights the same way: Megatron 1-D).
# Biases follow their outputs: q/k/v and gate/up biases are split with their rows (they travel with
# the weight shard); o_proj and down_proj biases are added once per token after the sum over
# shards, so they are replicated and their gradient is summed over the group like a norm's.
TSP_PLAN: list[tuple[str, int | None]] = [
    ("embed_tokens.weight", 0),                 # vocab rows
    ("layers.*.self_attn.[qkv]_proj.weight", 0),  # head rows (column parallel)
    ("layers.*.self_attn.[qkv]_proj.bias", 0),  # the same heads
    ("layers.*.self_attn.o_proj.weight", 1),    # head columns (row parallel)
    ("layers.*.self_attn.o_proj.bias", None),   # replicated
    ("layers.*.mlp.gate_proj.weight", 0),
    ("layers.*.mlp.up_proj.weight", 0),
    ("layers.*.mlp.gate_proj.bias", 0),         # intermediate rows, with their weights
    ("layers.*.mlp.up_proj.bias", 0),
    ("layers.*.mlp.down_proj.weight", 1),
    ("layers.*.mlp.down_proj.bias", None),      # replicated
    ("lm_head.weight", 0),                      # vocab rows
    ("*norm.weight", None),                     # replicated (block norms, Qwen3's per-head q/k norms)
]


def plan_specs(names, plan: list[tuple[str, int | None]], degree: int, axis: str,
               kv_repeat: int = 1) -> dict[str, ShardSpec]:
    """name -> its ShardSpec under `plan` split `degree` ways over `axis`. kv_repeat > 1 (K/V heads
    fewer than the degree): the K/V projections are split into degree / kv_repeat head blocks, each
    held by kv_repeat consecutive ranks (ModelConfig.kv_repeat)."""
    specs = {}
    for name in names:
        dims = [dim for pattern, dim in plan if fnmatch.fnmatchcase(name, pattern)]
        if not dims:
            raise KeyError(f"parameter {name!r} matches no entry of the sharding plan")
        specs[name] = ShardSpec(dims[0], degree if dims[0] is not None else 1, axis)
        if kv_repeat > 1 and fnmatch.fnmatchcase(name, KV_PROJECTIONS):
            specs[name] = ShardSpec(dims[0], degree // kv_repeat, axis, repeat=kv_repeat)
    return specs


KV_PROJECTIONS = "layers.*.self_attn.[kv]_proj.*"     # weights and biases of the K/V heads


VOCAB_ROWS = ("embed_tokens.weight", "lm_head.weight")


def tsp_specs(model: Transformer, degree: int) -> dict[str, ShardSpec]:
    specs = plan_specs([n for n, _ in model.named_parameters(remove_duplicate=False)], TSP_PLAN,
                       degree, "tsp", model.cfg.kv_repeat(degree))
    return with_vocab_padding(specs, model.cfg.vocab_size)


def with_vocab_padding(specs: dict[str, ShardSpec], vocab_size: int) -> dict[str, ShardSpec]:
    """The vocabulary rows' specs record the true vocabulary when the degree does not divide it
    (its shards are then padded, config.model.padded_vocab_size)."""
    out = dict(specs)
    for name in VOCAB_ROWS:
        spec = out.get(name)
        if spec is not None and spec.dim is not None and vocab_size % spec.degree:
            out[name] = dataclasses.replace(spec, size=vocab_size)
    return out


def apply_tsp(model: Transformer, comm: Comm, *, head_buckets: int = 1, seq_len: int | None = None,
              init_seed: int | None = None, recompute: str = "full",
              loss_chunk_tokens: int | str = "auto",
              mlp_chunk_tokens: int | str = "auto",
              checkpoint_replay_keeps: str = "all", kv_comm: Comm | None = None,
              attention_chunk_tokens: int | str = "auto") -> dict[str, ShardSpec]:
    """Shard `model` in place for TSP over `comm` (the tsp group). The model may be real (shards
    are sliced from its weights) or on the meta device (shards are initialised from `init_seed`
    with init_parameter, one full parameter at a time: the same values a plain model gets).
    `loss_chunk_tokens`: the LM head's token chunks (parallel/loss_chunks.py);
    `mlp_chunk_tokens`: the layers' token chunks (parallel/gated_mlp.py);
    `checkpoint_replay_keeps`: what each block's replay keeps under activation checkpointing
    ("all", "attention" or "nothing"; tsp/kept.py);
    `kv_comm`: with K/V heads fewer than D, the ranks sharing this rank's K/V head
    (mesh.build_kv_comm), over which the copies' gradients are summed; `attention_chunk_tokens`:
    the local tokens of each K/V chunk of attention (tsp/chunked.py; K/V head copies gather whole)."""
    cfg = model.cfg
    check_parallel_shapes(cfg, scheme="tsp", degree=comm.size, seq_len=seq_len,
                          head_buckets=head_buckets)
    kv_replicated = kv_copies(cfg, comm.size, kv_comm)
    specs = tsp_specs(model, comm.size)
    local = LocalShards(model, specs, comm.rank, init_seed)
    tiling = TokenTiling(mlp_chunk_tokens, cfg.intermediate_size // comm.size)
    replay_attention, replay_mlp = replay_keeps(checkpoint_replay_keeps)
    replicated = ReplicatedGrads(comm)        # norms and o/down biases: one gradient sum per pass
    for i, block in enumerate(model.layers):
        pre = f"layers.{i}."
        attn, mlp = pre + "self_attn.", pre + "mlp."
        weights, biases = local.attention(attn, cfg)
        block.self_attn = TSPAttention(*weights, head_dim=cfg.head_dim, comm=comm,
                                       head_buckets=head_buckets, recompute=recompute,
                                       tiling=tiling, replay_keeps=replay_attention,
                                       replicated=replicated, kv_replicated=kv_replicated,
                                       attention_chunk_tokens=attention_chunk_tokens,
                                       **local.head_norms(attn, cfg), **biases)
        weights, biases = local.mlp(mlp, cfg)
        block.mlp = TSPGatedMLP(*weights, comm=comm, keep_gate_up=recompute == "none",
                                tiling=tiling, replay_keeps=replay_mlp, replicated=replicated, **biases)
        # each norm hands its work to its consumer once the layer's tokens are tiled (tsp/norm.py)
        block.input_layernorm = TSPRMSNorm(materialize_norm(block.input_layernorm, local,
                                                        pre + "input_layernorm"), replicated=replicated,
                                           tiling=tiling)
        block.post_attention_layernorm = TSPRMSNorm(
            materialize_norm(block.post_attention_layernorm, local, pre + "post_attention_layernorm"),
            replicated=replicated, tiling=tiling)
        block.self_attn.norm_handoff = block.input_layernorm.handoff
        block.mlp.norm_handoff = block.post_attention_layernorm.handoff
    model.norm = TSPRMSNorm(materialize_norm(model.norm, local, "norm"), replicated=replicated)
    embed = nn.Parameter(local("embed_tokens.weight"))
    head = embed if cfg.tie_embeddings else nn.Parameter(local("lm_head.weight"))
    model.embed_tokens = TSPEmbedding(embed, comm=comm, vocab_size=cfg.vocab_size,
                                      loss_chunk_tokens=loss_chunk_tokens)
    # every pass starts with the embedding (Transformer.hidden_states): the replicated views open there
    model.embed_tokens.register_forward_pre_hook(replicated.begin_pass)
    if kv_replicated is not None:
        model.embed_tokens.register_forward_pre_hook(kv_replicated.begin_pass)
    model.lm_head = TSPLMHead(head, comm=comm, vocab_size=cfg.vocab_size,
                              loss_chunk_tokens=loss_chunk_tokens)
    mark_model_parallel(model, specs, axis_rank=comm.rank)
    return specs


def kv_copies(cfg, degree: int, kv_comm: Comm | None) -> ReplicatedGrads | None:
    """The K/V head copies' gradient sum over `kv_comm` when D / n_kv ranks share each K/V head
    (ModelConfig.kv_repeat > 1); None otherwise."""
    repeat = cfg.kv_repeat(degree)
    if repeat == 1:
        return None
    if kv_comm is None or kv_comm.size != repeat:
        raise ValueError(f"model.num_kv_heads={cfg.num_kv_heads} < D={degree}: each K/V head is copied "
                         f"on {repeat} ranks, whose gradients need their group (mesh.build_kv_comm), "
                         f"got {kv_comm}")
    return ReplicatedGrads(kv_comm, KV_GRAD_TAG)


REPLAY_KEEPS = typing.get_args(ReplayKeeps)      # parallel.checkpoint_replay_keeps


def replay_keeps(value: str) -> tuple[bool, bool]:
    """(attention, MLP): whether a block's activation-checkpoint replay keeps that part's
    activations for its backward under `parallel.checkpoint_replay_keeps=value`."""
    if value not in REPLAY_KEEPS:
        raise ValueError(f"parallel.checkpoint_replay_keeps={value!r} is not one of {REPLAY_KEEPS}")
    return value in ("all", "attention"), value == "all"


class LocalShards:
    """name -> this rank's shard, sliced from the real weight or initialised from the seed."""

    def __init__(self, model: nn.Module, specs: dict[str, ShardSpec], rank: int, seed: int | None):
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.specs, self.rank, self.seed, self.std = specs, rank, seed, model.cfg.init_std

    def __call__(self, name: str) -> torch.Tensor:
        p = self.params[name]
        if p.is_meta:
            if self.seed is None:
                raise ValueError("parallelizing a meta-device model needs init_seed")
            full = init_parameter(name, tuple(p.shape), seed=self.seed, std=self.std)
        else:
            full = p.detach()
        return self.specs[name].local(full, self.rank)

    def biases(self, prefix: str, projections) -> tuple[torch.Tensor, ...]:
        """This rank's shards of `prefix + "{p}_proj.bias"` for each projection p."""
        return tuple(self(f"{prefix}{p}_proj.bias") for p in projections)

    def attention(self, prefix: str, cfg) -> tuple[tuple[torch.Tensor, ...], dict]:
        """This rank's (W_q, W_k, W_v, W_o) of `prefix` ("layers.i.self_attn.") and the bias
        keywords every scheme's attention block takes (qkv_bias, o_bias; None when absent)."""
        weights = tuple(self(f"{prefix}{n}_proj.weight") for n in "qkvo")
        return weights, {"qkv_bias": self.biases(prefix, "qkv") if cfg.qkv_bias else None,
                         "o_bias": self(prefix + "o_proj.bias") if cfg.o_bias else None}

    def head_norms(self, prefix: str, cfg) -> dict:
        """The keywords for the per-head q/k norms of `prefix` (Qwen3): their replicated weights
        [head_dim] and eps; none when the model has no such norms."""
        if not cfg.qk_norm:
            return {}
        return {"head_norms": tuple(nn.Parameter(self(f"{prefix}{n}_norm.weight")) for n in "qk"),
                "norm_eps": cfg.norm_eps}

    def mlp(self, prefix: str, cfg) -> tuple[tuple[torch.Tensor, ...], dict]:
        """This rank's (W_gate, W_up, W_down) of `prefix` ("layers.i.mlp.") and the bias keywords
        (gate_up_bias, down_bias; None when the model has no MLP biases)."""
        weights = tuple(self(f"{prefix}{n}_proj.weight") for n in ("gate", "up", "down"))
        return weights, {"gate_up_bias": self.biases(prefix, ("gate", "up")) if cfg.mlp_bias else None,
                         "down_bias": self(prefix + "down_proj.bias") if cfg.mlp_bias else None}


def materialize_norm(norm: nn.Module, local: LocalShards, prefix: str) -> nn.Module:
    """A norm left on the meta device gets its (replicated) initial weight."""
    if norm.weight.is_meta:
        norm.weight = nn.Parameter(local(prefix + ".weight"))
    return norm


def mark_model_parallel(model: nn.Module, specs: dict[str, ShardSpec], *,
                        counts_shards: bool = True, axis_rank: int = 0) -> None:
    """Flag sharded parameters the way DeepSpeed (and Megatron) expect, so gradient-norm clipping
    counts each shard once on every model-parallel rank and replicated weights once (DeepSpeed
    counts unflagged parameters on model-parallel rank 0 only). counts_shards=False on ranks whose
    shards duplicate another rank's (tp x sp: the sp copies of a tp shard), so each is counted once;
    likewise a block held by `repeat` ranks (K/V head copies) counts on the first of them only
    (`axis_rank`: this rank on the split axis; the first holder of block 0 is model-parallel rank 0)."""
    for name, p in model.named_parameters():
        spec = specs[name]
        first_copy = axis_rank % spec.repeat == 0
        p.tensor_model_parallel = spec.dim is not None and counts_shards and first_copy
        p.partition_dim = -1 if spec.dim is None else spec.dim
        p.partition_stride = 1


@torch.no_grad()
def gather_full(tensors: dict[str, torch.Tensor], specs: dict[str, ShardSpec], comm: Comm) -> dict[str, torch.Tensor]:
    """All-gather every sharded tensor over `comm`; return full-shape tensors (on every rank)."""
    out = {}
    for name, tensor in tensors.items():
        spec = specs[name]
        if spec.dim is None or comm.size == 1:
            out[name] = tensor.detach().clone()
            continue
        parts = tensor.new_empty((comm.size,) + tuple(tensor.shape))
        comm.all_gather(parts.view((-1,) + tuple(tensor.shape[1:])), tensor.contiguous(),
                        tag="state.gather")
        blocks = list(parts.unbind(0))[::spec.repeat]         # one copy of each replicated block
        out[name] = spec.trim(torch.cat(blocks, dim=spec.dim))
    return out


def load_full_state_dict(model: nn.Module, full: dict[str, torch.Tensor], specs: dict[str, ShardSpec],
                         rank_of_axis: dict[str, int]) -> None:
    """Copy this rank's slice of each full tensor into the sharded model (reshard, import)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            spec = specs[name]
            p.copy_(spec.local(full[name], rank_of_axis.get(spec.axis, 0)))
