"""Apply a baseline scheme to the plain model and wrap it as a `Parallelized` (parallelized.py).

`apply_baseline(model, groups)` shards the weights with the same Megatron 1-D plan table as TSP
(TSP_PLAN: heads / intermediate block / vocabulary rows), but over the tp sub-axis only, and swaps
every block for its baseline module (layers.py), keeping parameter names. The scheme builders pick
the sub-axes of the model-parallel group (size D = mesh.tsp.size):

  tp       T = D, S = 1                         every rank holds the whole sequence
  tp_sp    T = D, S = 1, Megatron SP             norm/residual regions hold S/D contiguous tokens
  sp       T = 1, S = D                          zigzag tokens, weights whole on every rank
                                                (replicated, or ZeRO-3 shards: sharded_weights)
  tp_x_sp  T x S = D (tp inner, sp outer)        options tp_degree, sp_degree, tp_sequence_parallel
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from tsp_trainer.config.validate import check_parallel_shapes
from tsp_trainer.model.layers import PositionRuns
from tsp_trainer.model.transformer import Transformer
from tsp_trainer.parallel import zigzag
from tsp_trainer.parallel.apply import (TSP_PLAN, LocalShards, ShardSpec, mark_model_parallel,
                                        materialize_norm,
                                        plan_specs, with_vocab_padding)
from tsp_trainer.config.model import padded_vocab_size
from tsp_trainer.parallel.baselines.layers import (Groups, ParallelAttention, ParallelEmbedding,
                                                   ParallelLMHead, ParallelMLP, ParallelRMSNorm)
from tsp_trainer.parallel.comm import Comm
from tsp_trainer.parallel.gated_mlp import TokenTiling
from tsp_trainer.parallel.mesh import Mesh, axis_view, build_kv_comm, build_tp_sp_comms
from tsp_trainer.parallel.parallelized import Parallelized

# The Megatron 1-D weight split is the one TSP uses for its resting shards (parallel/apply.py).
BASELINE_PLAN = TSP_PLAN


def apply_baseline(model: Transformer, groups: Groups, *, init_seed: int | None = None,
                   loss_chunk_tokens: int | str = "auto",
                   mlp_chunk_tokens: int | str = "auto") -> dict[str, ShardSpec]:
    """Shard `model` in place over groups.tp (T-way Megatron split; replicated when T = 1) and swap
    in the baseline blocks. A meta-device model is initialised from `init_seed`, one full parameter
    at a time (the values the plain model gets from init_weights). `loss_chunk_tokens`: the LM
    head's token chunks (parallel/loss_chunks.py); `mlp_chunk_tokens`: the MLP's
    (parallel/gated_mlp.py)."""
    cfg, t = model.cfg, groups.tp.size
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    specs = (with_vocab_padding(plan_specs(names, BASELINE_PLAN, t, "tp", cfg.kv_repeat(t)), cfg.vocab_size)
             if t > 1 else {n: ShardSpec(None, 1, "sp") for n in names})
    if cfg.kv_repeat(t) > 1 and (groups.kv_grad is None or groups.kv_grad.size != cfg.kv_repeat(t)):
        raise ValueError(f"model.num_kv_heads={cfg.num_kv_heads} < T={t}: each K/V head is copied on "
                         f"{cfg.kv_repeat(t)} tp ranks, whose gradients need Groups.kv_grad "
                         f"(mesh.build_kv_comm), got {groups.kv_grad}")
    local = LocalShards(model, specs, groups.tp.rank, init_seed)
    tiling = TokenTiling(mlp_chunk_tokens, cfg.intermediate_size // t)
    for i, block in enumerate(model.layers):
        pre = f"layers.{i}."
        attn, mlp = pre + "self_attn.", pre + "mlp."
        weights, biases = local.attention(attn, cfg)
        block.self_attn = ParallelAttention(*weights, head_dim=cfg.head_dim, groups=groups,
                                            **local.head_norms(attn, cfg), **biases)
        weights, biases = local.mlp(mlp, cfg)
        block.mlp = ParallelMLP(*weights, groups=groups, tiling=tiling, **biases)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            setattr(block, norm, _norm(getattr(block, norm), local, pre + norm, groups))
    model.norm = _norm(model.norm, local, "norm", groups)
    vocab_start = groups.tp.rank * (padded_vocab_size(cfg.vocab_size, t) // t)
    embed = nn.Parameter(local("embed_tokens.weight"))
    head = embed if cfg.tie_embeddings else nn.Parameter(local("lm_head.weight"))
    model.embed_tokens = ParallelEmbedding(embed, vocab_start=vocab_start, groups=groups)
    model.lm_head = ParallelLMHead(head, vocab_start=vocab_start, groups=groups,
                                   loss_chunk_tokens=loss_chunk_tokens, vocab_size=cfg.vocab_size)
    # DeepSpeed's model-parallel group is the whole D group: count each tp shard on sp rank 0 only.
    mark_model_parallel(model, specs, counts_shards=groups.sp.rank == 0, axis_rank=groups.tp.rank)
    return specs


def _norm(norm, local: LocalShards, prefix: str, groups: Groups) -> ParallelRMSNorm:
    return ParallelRMSNorm(materialize_norm(norm, local, prefix), comm=groups.norm_grad)


# ---------------------------------------------------------------------------------------------
# Scheme builders (entries of the table parallel/schemes.py SCHEMES)


def build_tp(model: Transformer, mesh: Mesh, **kw) -> Parallelized:
    """Megatron TP over the D ranks: all-reduce around the TP regions, full sequence everywhere."""
    _check(model, "tp", mesh, kw)
    tp = axis_view(mesh.tsp, "tp")
    groups = Groups(tp, _single(mesh, "sp"), False, None, _whole(mesh, tp))
    return _wrap(model, mesh, "tp", groups, kw)


def build_tp_sp(model: Transformer, mesh: Mesh, **kw) -> Parallelized:
    """Megatron TP + sequence parallelism over the D ranks (all-gather / reduce-scatter)."""
    _check(model, "tp_sp", mesh, kw)
    tp = axis_view(mesh.tsp, "tp")
    return _wrap(model, mesh, "tp_sp", Groups(tp, _single(mesh, "sp"), True, tp, _whole(mesh, tp)), kw)


def build_sp(model: Transformer, mesh: Mesh, *, sharded_weights: bool = False, **kw) -> Parallelized:
    """Context parallelism over the D ranks: zigzag tokens, K/V all-gather, each layer's weights
    whole during its compute. sharded_weights: DeepSpeed ZeRO-3 keeps them sharded over the axis
    x dp between uses and reduces their gradients over that set (no sum over sp here);
    otherwise they are replicated and their gradients summed over sp inside autograd."""
    _check(model, "sp", mesh, kw)
    sp = axis_view(mesh.tsp, "sp")
    return _wrap(model, mesh, "sp", sp_groups(mesh, sp, sharded_weights=sharded_weights), kw)


def sp_groups(mesh: Mesh, sp: Comm, *, sharded_weights: bool, **attend) -> Groups:
    """The Groups of a scheme whose tokens are split over the whole axis (T = 1): `sp` and
    `ulysses`. With sharded_weights no gradient is summed over sp in autograd (ZeRO-3 reduces
    every weight's gradient over the axis x dp)."""
    if sharded_weights:
        return Groups(_single(mesh, "tp"), sp, False, None, None, **attend, sums_weight_grads=False)
    return Groups(_single(mesh, "tp"), sp, False, _whole(mesh, sp), _whole(mesh, sp), **attend)


def build_tp_x_sp(model: Transformer, mesh: Mesh, *, tp_degree: int | None = None,
                  sp_degree: int | None = None, tp_sequence_parallel: bool = False, **kw) -> Parallelized:
    """TP over a T-way sub-axis (inner) x context parallelism over an S-way sub-axis (outer).
    tp_sequence_parallel adds Megatron SP inside each tp group (tokens split S x T ways outside the
    TP region)."""
    _check(model, "tp_x_sp", mesh, kw, tp_degree=tp_degree, sp_degree=sp_degree)
    seq_len = kw.get("seq_len")
    if tp_sequence_parallel and seq_len is not None and (seq_len // sp_degree) % tp_degree:
        raise ValueError(f"data.seq_len={seq_len} is not divisible by parallel.sp_degree x "
                         f"parallel.tp_degree = {sp_degree} x {tp_degree} with tp_sequence_parallel "
                         f"(each zigzag slice is split {tp_degree} ways); use a multiple of "
                         f"{2 * sp_degree * tp_degree}")
    tp, sp = build_tp_sp_comms(mesh, tp_degree, sp_degree)
    # Norm inputs are split over sp, and over tp too under Megatron SP: then sum over all D ranks.
    norm_grad = (axis_view(mesh.tsp, "tsp") if tp_sequence_parallel else sp) if mesh.tsp.size > 1 else None
    whole = axis_view(mesh.tsp, "tsp") if mesh.tsp.size > 1 else None
    groups = Groups(tp, sp, bool(tp_sequence_parallel), norm_grad, whole)
    return _wrap(model, mesh, "tp_x_sp", groups, kw)


def _check(model: Transformer, scheme: str, mesh: Mesh, kw: dict, **two_axes) -> None:
    """The shape rules of config/validate.py, before any process-group work. tp_degree/sp_degree
    given to another scheme reach check_parallel_shapes, which explains they are tp_x_sp's."""
    two_axes = {k: kw.get(k, two_axes.get(k)) for k in ("tp_degree", "sp_degree")}
    unknown = set(kw) - {"seq_len", "head_buckets", "init_seed", "tp_degree", "sp_degree",
                         "loss_chunk_tokens", "mlp_chunk_tokens"}
    if unknown:
        extra = ", tp_degree, sp_degree, tp_sequence_parallel" if scheme == "tp_x_sp" else ""
        raise ValueError(f"parallel scheme {scheme!r} got unknown option(s) {sorted(unknown)}; its "
                         f"options are seq_len, init_seed, loss_chunk_tokens, mlp_chunk_tokens{extra}")
    check_parallel_shapes(model.cfg, scheme=scheme, degree=mesh.tsp.size, seq_len=kw.get("seq_len"),
                          head_buckets=kw.get("head_buckets", 1), **two_axes)


def _whole(mesh: Mesh, comm: Comm) -> Comm | None:
    """`comm` spanning the whole model-parallel group, as the per-head q/k norms' gradient group;
    None when D = 1 (nothing to sum)."""
    return comm if mesh.tsp.size > 1 else None


def _single(mesh: Mesh, axis: str) -> Comm:
    """A size-1 Comm (an absent sub-axis): every op is a local no-op."""
    return Comm(None, [mesh.rank], 0, mesh.ledger, axis, device=mesh.device)


def _wrap(model: Transformer, mesh: Mesh, scheme: str, groups: Groups, kw: dict) -> Parallelized:
    t = groups.tp.size            # K/V heads fewer than T: the copies' group (after the shape rules)
    groups = dataclasses.replace(groups, kv_grad=build_kv_comm(mesh, model.cfg.kv_repeat(t), tp_degree=t))
    specs = apply_baseline(model, groups, init_seed=kw.get("init_seed"),
                           loss_chunk_tokens=kw.get("loss_chunk_tokens", "auto"),
                           mlp_chunk_tokens=kw.get("mlp_chunk_tokens", "auto"))
    sp = groups.sp

    def layout(ids: torch.Tensor, labels: torch.Tensor):
        # TP region ranks all see the same tokens (Megatron hands every TP rank the full batch);
        # the sp sub-axis takes its zigzag slice, positions following the tokens.
        if sp.size > 1:
            return zigzag.shard_batch(ids, labels, sp.rank, sp.size)
        return ids, labels, PositionRuns.contiguous(ids.shape[1])

    axis_comms = {c.axis: c for c in (groups.tp, groups.sp) if c.size > 1} or {"tp": groups.tp}
    token_comms = [sp] if sp.size > 1 else []
    info = {"tp_degree": groups.tp.size, "sp_degree": sp.size,
            "sequence_parallel": groups.sequence_parallel}
    return Parallelized(model, specs, scheme, mesh, token_comms, axis_comms, layout, info)
