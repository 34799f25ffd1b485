"""Closed-form communication of the baselines: the ledger bytes one rank records for one forward +
backward of `Transformer.loss_sum` plus the global token count (parallel/loss.py), keyed "op/tag"
like `CommLedger.summary()`, in the ledger's payload conventions (ledger.py). The formulas, per
scheme and tag, are tabled in docs/parallelism.md, "Baseline communication formulas";
tests/distributed/test_baselines.py asserts the ledger equals them exactly. `ulysses`
(parallel/ulysses.py) is `sp`'s layout with the K/V all-gather replaced by the all-to-alls of
DeepSpeed's DistributedAttention (`ulysses_all_to_all_bytes`); tests/distributed/test_bench.py
asserts the ledger equals it.
"""

from __future__ import annotations

import collections

from tsp_trainer.config.model import ModelConfig, padded_vocab_size
from tsp_trainer.parallel.grad_sync import GRAD_BYTES


def scheme_axes(scheme: str, degree: int, tp_degree: int | None = None, sp_degree: int | None = None,
                tp_sequence_parallel: bool = False) -> tuple[int, int, bool]:
    """(T, S, Megatron SP) of a baseline with model-parallel degree D."""
    if scheme == "tp":
        return degree, 1, False
    if scheme == "tp_sp":
        return degree, 1, True
    if scheme in ("sp", "ulysses"):
        return 1, degree, False
    if scheme == "tp_x_sp":
        assert tp_degree * sp_degree == degree, "tp_degree x sp_degree must equal the degree"
        return tp_degree, sp_degree, bool(tp_sequence_parallel)
    raise ValueError(f"parallel.scheme={scheme!r} is not a baseline; use tp, tp_sp, sp, tp_x_sp or ulysses")


def expected_ledger_bytes(cfg: ModelConfig, scheme: str, *, degree: int, batch: int, seq_len: int,
                          tp_degree: int | None = None, sp_degree: int | None = None,
                          tp_sequence_parallel: bool = False, dtype_bytes: int = 4,
                          sharded_weights: bool = False) -> dict[str, int]:
    """Ledger bytes per "op/tag" on one rank for one forward + backward (see the module docstring).
    sharded_weights (sp, ulysses under ZeRO-3): no gradient is summed over the axis here (DeepSpeed
    reduce-scatters them all, parallel/sharded_weights.py Zero3Traffic has those bytes)."""
    t, s, seq_par = scheme_axes(scheme, degree, tp_degree, sp_degree, tp_sequence_parallel)
    if sharded_weights and t > 1:
        raise ValueError(f"sharded_weights with scheme {scheme!r}: only sp and ulysses run under ZeRO-3")
    h, e, layers = cfg.hidden_size, dtype_bytes, cfg.num_layers
    n = batch * seq_len // s
    a = n * h * e
    out: dict[str, int] = collections.defaultdict(int)
    if t > 1:
        if seq_par:
            for op in ("all_gather", "reduce_scatter"):
                out[f"{op}/attn.tp"] += 2 * layers * a
                out[f"{op}/mlp.tp"] += 2 * layers * a
                out[f"{op}/embed.tp"] += a
                out[f"{op}/head.tp"] += a
        else:
            out["all_reduce/attn.tp"] += 2 * layers * a
            out["all_reduce/mlp.tp"] += 2 * layers * a
            out["all_reduce/embed.tp"] += a
            out["all_reduce/head.tp"] += a
        out["all_reduce/head.ce"] += 3 * n * 4
    h_kv = cfg.kv_shard_hidden(t)                        # K/V channels per tp rank (a copy if fewer)
    if cfg.kv_repeat(t) > 1:          # the K/V head copies: weights and biases summed over the sharers
        out["all_reduce/kv.grad"] += layers * 2 * h_kv * (h + int(cfg.qkv_bias)) * GRAD_BYTES
    if s > 1 and scheme == "ulysses":      # q, k, v, o through all-to-alls instead of K/V gathers
        for key, nbytes in ulysses_all_to_all_bytes(cfg, degree=s, batch=batch, seq_len=seq_len,
                                                    dtype_bytes=e).items():
            out[key] += nbytes
    elif s > 1:
        kv = batch * seq_len * 2 * h_kv * e
        out["all_gather/attn.kv"] += 2 * layers * kv
        out["reduce_scatter/attn.dkv"] += layers * kv
    if s > 1:
        out["all_reduce/loss.count"] += 8
    if sharded_weights:
        return dict(out)
    if s > 1:
        vocab = padded_vocab_size(cfg.vocab_size, t)              # padded to a multiple of T
        out["all_reduce/wgrad"] += (layers * cfg.attn_shard_params(t)
                                    + (layers * cfg.mlp_sharded_params + 2 * vocab * h) // t) * GRAD_BYTES
    if t * s > 1 and cfg.qk_norm:     # q_norm, k_norm: other heads or tokens on every rank of the group
        out["all_reduce/norm.grad"] += layers * cfg.head_norm_params * GRAD_BYTES
    norms_split = (s > 1) or (seq_par and t > 1)
    if norms_split:
        out["all_reduce/norm.grad"] += (2 * layers + 1) * h * GRAD_BYTES
        if cfg.replicated_biases:
            out["all_reduce/bias.grad"] += layers * cfg.replicated_biases * GRAD_BYTES
    return dict(out)


def ulysses_all_to_all_bytes(cfg: ModelConfig, *, degree: int, batch: int, seq_len: int,
                             dtype_bytes: int = 4, forward_replays: int = 1) -> dict[str, int]:
    """Ledger bytes of Ulysses' all-to-alls on one rank for one forward + backward: per layer, q,
    k, v and the attention output go through one all-to-all forward ("attn.a2a.q" ...) and their
    gradients one backward ("attn.a2a.dq" ...), each recorded as the local tensor it is given,
    [B, S/D, heads, head_dim] (parallel/ulysses.py). K/V heads fewer than D are repeated up to D.
    `forward_replays` = 2 under activation checkpointing (the block's replay re-runs the forward
    ones)."""
    if degree == 1:
        return {}
    per_head = batch * (seq_len // degree) * cfg.head_dim * dtype_bytes * cfg.num_layers
    kv = max(cfg.num_kv_heads, degree)
    out = {}
    for name, heads in (("q", cfg.num_heads), ("k", kv), ("v", kv), ("o", cfg.num_heads)):
        out[f"all_to_all/attn.a2a.{name}"] = per_head * heads * forward_replays
        out[f"all_to_all/attn.a2a.d{name}"] = per_head * heads
    return out


def bytes_by_op(by_tag: dict[str, int]) -> dict[str, int]:
    """Collapse "op/tag" keys to op kinds."""
    out: dict[str, int] = collections.defaultdict(int)
    for key, nbytes in by_tag.items():
        out[key.split("/")[0]] += nbytes
    return dict(out)
