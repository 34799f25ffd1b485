"""The rules of a TrainConfig: each key's own rule (its choices, bound or allowed values, read from
the schema's settings) and the cross-field rules. Each failure is a ValueError naming key(s),
value(s), the rule and a hint, e.g.
`parallel.tsp_degree=3 does not divide model.num_heads=16; use one of 1, 2, 4, 8, 16`.

`check_parallel_shapes` is the pure shape rule of every scheme; the parallel package calls it before
any process-group work, so a bad degree fails with this message rather than as a shape error deep
inside a collective.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from typing import Any, Literal

from tsp_trainer.config.model import FP32_EXACT_POSITIONS, ModelConfig
from tsp_trainer.config.schema import (SHARDED_WEIGHT_SCHEMES, ModelSection, ParallelSection, Scheme, TrainConfig,
                                       ZeroSection, resolved_zero_stage)
from tsp_trainer.config.settings import Bound, bound_of, choices_of, field_of, list_of_sections

SCHEMES: tuple[str, ...] = typing.get_args(Scheme)

# Weight matrices are split along these dims by every weight-sharding scheme (heads of W_q/W_k/W_v,
# the intermediate dim of the gated MLP). K/V heads fewer than the degree are copied instead (each
# on D / n_kv ranks, ModelConfig.kv_repeat), so they need D to be a divisor or a multiple of n_kv;
# they come first: the more useful message. The vocabulary rows of the embedding and LM head
# are split too, but padded to a multiple of the degree (config.model.padded_vocab_size): any
# vocabulary size runs.
_SHARDED_DIMS = ("num_kv_heads", "num_heads", "intermediate_size")

# scheme -> (splits the weights, sequence chunks per rank: 2 = zigzag, 1 = contiguous, 0 = none).
# Zigzag cuts each sequence into 2D chunks (rank p takes p and 2D-1-p) to balance causal work;
# Megatron TP+SP splits the sequence contiguously around the TP region.
_SCHEME_AXES = {"tsp": (True, 2), "tp": (True, 0), "tp_sp": (True, 1), "sp": (False, 2),
                "tp_x_sp": (True, 2), "ulysses": (False, 1)}


def validate_config(cfg: TrainConfig, world_size: int | None = None) -> None:
    """Raise ValueError on the first broken rule. `world_size` adds the mesh rules when known."""
    _check_choices(cfg)
    _check_bounds(cfg, "")
    _check_zero(cfg.zero.stage, cfg.parallel.scheme)
    check_optimizer_offload(cfg.zero, cfg.parallel.scheme)
    check_precision(zero_stage=cfg.zero.stage, bf16=cfg.train.dtype == "bf16")
    if cfg.zero.stage == 0 and cfg.train.nonfinite == "skip":
        raise ValueError("train.nonfinite='skip' needs zero.stage 1 or 2 (their overflow check, agreed "
                         "over all ranks, is what skips the update); zero.stage=0 has none: use "
                         "zero.stage 1 or 2, or train.nonfinite='stop'")
    # The named size or the folder's config.json with the recipe's keys (model_source.py); the
    # ModelConfig checks its own shape (head_dim, GQA groups, family rules).
    model = cfg.model.to_model_config()
    cfg.tokenizer_source()                # a model folder without a tokenizer needs data.tokenizer
    _check_model_floats(model)
    _check_lifecycle(cfg)
    p = cfg.parallel
    check_parallel_shapes(model, scheme=p.scheme, degree=p.tsp_degree, seq_len=cfg.data.seq_len,
                          head_buckets=shape_buckets(p), tp_degree=p.tp_degree, sp_degree=p.sp_degree)
    check_ulysses_head_chunks(model, scheme=p.scheme, degree=p.tsp_degree, head_chunks=p.ulysses_head_chunks)
    _check_tsp_recompute(cfg)
    _check_attention_chunk(cfg)
    _check_nested_checkpoint(cfg)
    _check_batch(cfg, resolve_dp_degree(p, world_size))
    _check_schedule(cfg, model)
    _check_eval(cfg, model)
    _check_data_sources(cfg)
    _check_document_masking(cfg)
    _check_length_schedule(cfg, model)
    _check_paths(cfg)


def check_parallel_shapes(model_cfg: ModelConfig, *, scheme: str, degree: int, seq_len: int | None,
                          head_buckets: int = 1, tp_degree: int | None = None,
                          sp_degree: int | None = None, seq_key: str = "data.seq_len") -> None:
    """Check that the model and sequence split evenly under `scheme` with model-parallel degree D.

    Args:
        degree: D, the size of the model-parallel group (`parallel.tsp_degree`) for every scheme.
        seq_len: tokens per sequence before sharding; None skips the sequence rules.
        tp_degree, sp_degree: T and S of scheme tp_x_sp (T x S = D); None for the other schemes.
        seq_key: the key `seq_len` came from, for the message (e.g. eval.passkey_lengths[1]).
    """
    _check_scheme_args(scheme, degree, seq_len, head_buckets, tp_degree, sp_degree, seq_key)
    splits_weights, chunks = _SCHEME_AXES[scheme]
    if scheme == "tp_x_sp":   # two axes inside the group: T splits the weights, S the sequence
        weight_axis, seq_axis = ("parallel.tp_degree", tp_degree), ("parallel.sp_degree", sp_degree)
    else:
        weight_axis = seq_axis = ("parallel.tsp_degree", degree)
    # The degrees a message offers must also pass the sequence rule when one key governs both.
    same_key = seq_axis[0] == weight_axis[0]
    seq_rule = (seq_len, chunks) if chunks and seq_len is not None and same_key else None
    if splits_weights:
        _check_weight_split(model_cfg, *weight_axis, seq_rule=seq_rule,
                            other_schemes=scheme != "tp_x_sp", seq_len=seq_len)
    if chunks and seq_len is not None:
        _check_sequence_split(seq_len, *seq_axis, chunks=chunks, seq_key=seq_key)
    if scheme == "tsp":
        _check_head_buckets(model_cfg, degree, head_buckets)
    if scheme == "ulysses":
        _check_ulysses_heads(model_cfg, degree)


def check_sliding_window(model_cfg: ModelConfig, seq_len: int, *, key: str = "data.seq_len") -> None:
    """A source model with an attention window (Mistral v0.1: 4096) is computed with full causal
    attention, which equals the windowed one only while the sequence fits in the window."""
    window = model_cfg.sliding_window
    if window is not None and seq_len > window:
        raise ValueError(f"{key}={seq_len} exceeds the model's sliding_window={window} "
                         f"({model_cfg.family}): tsp_trainer computes full causal attention, which "
                         f"equals the windowed one only up to the window; use {key} <= {window}")


def shape_buckets(parallel: ParallelSection) -> int:
    """parallel.head_buckets for the shape rules: `auto` chooses among the counts that divide the
    K/V heads per shard (plan/auto.py), of which 1 always does."""
    return 1 if parallel.head_buckets == "auto" else parallel.head_buckets


def check_exact_positions(seq_len: int, *, reset_positions: bool, key: str = "data.seq_len") -> None:
    """Positions count across the whole sequence unless they restart per document: past 2^24 the
    fp32 RoPE angles would round positions (FP32_EXACT_POSITIONS)."""
    if seq_len > FP32_EXACT_POSITIONS and not reset_positions:
        raise ValueError(f"{key}={seq_len} exceeds 2^24 = {FP32_EXACT_POSITIONS}: RoPE positions "
                         "past it are not exact in fp32 (the angles' dtype, as in transformers); "
                         "use at most 16777216 tokens or data.reset_positions=true with shorter "
                         "documents")


def resolve_dp_degree(parallel: ParallelSection, world_size: int | None) -> int | None:
    """DP degree = world_size // tsp_degree; checks `parallel.dp_degree` when both are known."""
    if world_size is None:
        return parallel.dp_degree
    _require_int("world size", world_size, 1)
    d, dp = parallel.tsp_degree, parallel.dp_degree
    if dp is not None and dp * d != world_size:
        raise ValueError(f"world size {world_size} is not dp_degree x tsp_degree = {dp} x {d} "
                         f"(parallel.dp_degree, parallel.tsp_degree); launch {dp * d} processes "
                         "or set parallel.dp_degree=null to derive it")
    if world_size % d:
        raise ValueError(f"world size {world_size} is not divisible by parallel.tsp_degree={d}; "
                         f"launch a multiple of {d} processes or use a degree in "
                         f"{_fmt_list(_divisors(world_size))}")
    return world_size // d


# ---------------------------------------------------------------------------------------------
# Single-field rules


def _check_choices(cfg: TrainConfig) -> None:
    """Every `Literal[...]` field of every section (the same choices the loader enforces)."""
    for section in dataclasses.fields(cfg):
        obj = getattr(cfg, section.name)
        for name, kind in typing.get_type_hints(type(obj)).items():
            choices = typing.get_args(kind) if typing.get_origin(kind) is Literal else None
            value = getattr(obj, name)
            if choices and value not in choices:
                raise ValueError(f"{section.name}.{name}={value!r} is not one of "
                                 f"{', '.join(map(repr, choices))}; pick one of them")
            words = literal_words(kind)
            if not choices and words and isinstance(value, str) and value not in words:
                kinds = [a.__name__ for a in typing.get_args(kind) if isinstance(a, type)]
                raise ValueError(f"{section.name}.{name}={value!r} must be "
                                 f"{' or '.join(map(repr, words))} or a {' or '.join(kinds)}")


def _check_bounds(section: Any, prefix: str) -> None:
    """Every key of `section` with a bound in its setting (schema.py), its sub-sections and lists
    of sections included (`data.sources[0].weight`); null passes where the type allows it."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        key, value, kind = prefix + f.name, getattr(section, f.name), hints[f.name]
        if dataclasses.is_dataclass(kind):
            _check_bounds(value, key + ".")
        elif list_of_sections(kind):
            for i, item in enumerate(value):
                _check_bounds(item, f"{key}[{i}].")
        elif (bound_of(f) is not None and not (value is None and _optional(kind))
              and value not in literal_words(kind)):
            _require_bound(key, value, bound_of(f), integer=_number_kind(kind) is int)


def literal_words(kind: Any) -> tuple:
    """The Literal choices inside a union such as `int | Literal["auto"]` (parallel.head_buckets)."""
    if typing.get_origin(kind) is Literal:
        return ()
    return tuple(w for a in typing.get_args(kind) if typing.get_origin(a) is Literal
                 for w in typing.get_args(a))


def _optional(kind: Any) -> bool:
    return type(None) in typing.get_args(kind)


def _number_kind(kind: Any) -> type:
    """int or float: the number type of `int`, `float` or `X | None`."""
    return next(a for a in (kind, *typing.get_args(kind)) if a in (int, float))


def _require_bound(key: str, value: Any, bound: Bound, *, integer: bool) -> None:
    if integer:
        if isinstance(value, bool) or not isinstance(value, int) or not bound.allows(value):
            raise ValueError(f"{key}={value!r} must be an integer {bound.text()}")
        return
    # Every bounded float must also be finite: an `.inf` learning rate would apply one update of
    # infinities and then skip every later step.
    rule = f"must be {bound.text()}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key}={value!r} must be a number; it {rule}")
    if not math.isfinite(value):
        raise ValueError(f"{key}={value!r} must be a finite number; it {rule}")
    if not bound.allows(value):
        raise ValueError(f"{key}={value!r} {rule}")


def _check_model_floats(model: ModelConfig) -> None:
    """The bounded model keys on the resolved model (a size's or folder's value, or the override)."""
    hints = typing.get_type_hints(ModelSection)
    for f in dataclasses.fields(ModelSection):
        if bound_of(f) is not None and hasattr(model, f.name):
            _require_bound(f"model.{f.name}", getattr(model, f.name), bound_of(f),
                           integer=_number_kind(hints[f.name]) is int)


def hang_dump_after_s(train) -> float:
    """train.hang_dump_s resolved: None means half of the collective timeout (the dump comes well
    before the timeout ends the job); 0 turns the watchdog off."""
    return train.collective_timeout_s / 2 if train.hang_dump_s is None else float(train.hang_dump_s)


def _check_lifecycle(cfg: TrainConfig) -> None:
    t = cfg.train
    if t.hang_dump_s and t.hang_dump_s >= t.collective_timeout_s:
        raise ValueError(f"train.hang_dump_s={t.hang_dump_s:g} must be below train.collective_timeout_s="
                         f"{t.collective_timeout_s} (the dump has to come before the timeout ends the "
                         "job); lower it or set it to 0 to turn hang dumps off")
    signals, known = t.preempt_signals, choices_of(field_of(type(t), "preempt_signals"))
    if not isinstance(signals, (list, tuple)) or any(s not in known for s in signals):
        raise ValueError(f"train.preempt_signals={list(signals) if isinstance(signals, (list, tuple)) else signals!r} "
                         f"must name signals among {', '.join(known)} (SIGKILL and SIGSTOP "
                         "cannot be caught; SIGINT stays Ctrl-C); use [] to disable")


def _check_zero(stage: Any, scheme: str) -> None:
    stages = choices_of(field_of(ZeroSection, "stage"))
    named = ", ".join(map(str, stages[:-1])) + f" or {stages[-1]}"        # "0, 1, 2 or 3"
    if stage == "auto":
        return
    if stage not in stages or isinstance(stage, bool):
        raise ValueError(f"zero.stage={stage!r} must be auto, {named} (DeepSpeed ZeRO stage)")
    if stage == 3 and scheme not in SHARDED_WEIGHT_SCHEMES:
        raise ValueError(f"zero.stage=3 with parallel.scheme={scheme!r}: ZeRO-3 shards the weights over "
                         f"the axis x dp, which only {' and '.join(SHARDED_WEIGHT_SCHEMES)} leave whole "
                         f"on the axis ({scheme} shards them over the axis itself); use zero.stage 0, 1 "
                         "or 2, or auto")


def check_optimizer_offload(zero: ZeroSection, scheme: str) -> None:
    """ZeRO-Offload moves the fp32 partition that ZeRO 1-3 build (master weights, AdamW moments,
    fp32 gradients) to the host; ZeRO-0 builds none, so DeepSpeedCPUAdam would meet device weights.
    Stage 3 is refused for the schemes other than sp and ulysses before this (_check_zero)."""
    stage = resolved_zero_stage(zero.stage, scheme)
    if zero.offload_optimizer == "cpu" and stage == 0:
        raise ValueError("zero.offload_optimizer='cpu' with zero.stage=0: the optimizer is offloaded only "
                         "under ZeRO 1, 2 or 3 (stage 0 keeps no fp32 partition to move to the host); "
                         "use zero.stage 1, 2 (or 3 for sp and ulysses), or zero.offload_optimizer='none'")


def check_precision(*, zero_stage: int, bf16: bool) -> None:
    """bf16 needs fp32 gradient accumulation, which DeepSpeed provides with ZeRO 1 and 2 only
    (train.dtype=auto resolves to bf16 on GPUs: the Trainer calls this again once it knows)."""
    if bf16 and zero_stage == 0:
        raise ValueError("zero.stage=0 with bf16 (train.dtype=bf16, or auto on GPUs) would accumulate "
                         "and reduce gradients in bf16 (DeepSpeed has no fp32 gradient accumulation "
                         "without ZeRO); use zero.stage 1 or 2, or train.dtype=fp32")


def _require_int(key: str, value: Any, minimum: int) -> None:
    _require_bound(key, value, Bound(minimum), integer=True)


def _require_setting(dotted: str, value: Any, *, key: str | None = None) -> None:
    """`value` keeps the bound of the schema key `dotted` (e.g. "parallel.tsp_degree"); the message
    names `key` (default `dotted`): a function argument checked like the key it stands for."""
    section, name = dotted.split(".")
    cls = typing.get_type_hints(TrainConfig)[section]
    _require_bound(key or dotted, value, bound_of(field_of(cls, name)), integer=True)


# ---------------------------------------------------------------------------------------------
# Parallel shapes


def _check_scheme_args(scheme: str, degree: int, seq_len: int | None, head_buckets: int,
                       tp_degree: int | None, sp_degree: int | None, seq_key: str) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"parallel.scheme={scheme!r} is not one of {', '.join(map(repr, SCHEMES))}")
    _require_setting("parallel.tsp_degree", degree)
    _require_setting("parallel.head_buckets", head_buckets)
    if seq_len is not None:
        _require_setting("data.seq_len", seq_len, key=seq_key)
    if scheme != "tsp" and head_buckets != 1:
        raise ValueError(f"parallel.head_buckets={head_buckets} is only used by parallel.scheme='tsp' "
                         f"(got {scheme!r}); set parallel.head_buckets=1")
    if scheme != "tp_x_sp":
        for key, value in (("parallel.tp_degree", tp_degree), ("parallel.sp_degree", sp_degree)):
            if value is not None:
                raise ValueError(f"{key}={value} is only used by parallel.scheme='tp_x_sp' (got "
                                 f"{scheme!r}, whose degree is parallel.tsp_degree); set it to null")
        return
    _check_two_axes(degree, tp_degree, sp_degree)


def _check_two_axes(degree: int, tp_degree: int | None, sp_degree: int | None) -> None:
    """tp_x_sp folds a T-way TP axis and an S-way SP axis into the D ranks of a group."""
    if tp_degree is None or sp_degree is None:
        raise ValueError(f"parallel.scheme='tp_x_sp' needs parallel.tp_degree and parallel.sp_degree "
                         f"(got {tp_degree} and {sp_degree}) with T x S = parallel.tsp_degree={degree}")
    _require_setting("parallel.tp_degree", tp_degree)
    _require_setting("parallel.sp_degree", sp_degree)
    if tp_degree * sp_degree != degree:
        pairs = ", ".join(f"{t} x {degree // t}" for t in _divisors(degree))
        raise ValueError(f"parallel.tp_degree x parallel.sp_degree = {tp_degree} x {sp_degree} = "
                         f"{tp_degree * sp_degree} is not parallel.tsp_degree={degree}; "
                         f"use T x S in {pairs}")


def _check_weight_split(model_cfg: ModelConfig, key: str, degree: int, *,
                        seq_rule: tuple[int, int] | None, other_schemes: bool = False,
                        seq_len: int | None = None) -> None:
    sizes = {name: getattr(model_cfg, name) for name in _SHARDED_DIMS}
    n_kv = sizes["num_kv_heads"]
    for name, size in sizes.items():
        copied = name == "num_kv_heads" and degree % size == 0    # fewer K/V heads: each copied
        if size % degree and not copied:
            bounds = [sizes["num_heads"], sizes["intermediate_size"]]
            if seq_rule and seq_rule[0] % seq_rule[1] == 0:
                bounds.append(seq_rule[0] // seq_rule[1])   # d | seq_len/chunks  <=>  chunks*d | seq_len
            working = [c for c in _divisors(math.gcd(*bounds)) if n_kv % c == 0 or c % n_kv == 0]
            hint = _scheme_hint(sizes, degree, seq_len) if other_schemes else ""
            rule = (f"{key}={degree} and model.num_kv_heads={size} divide neither way (K/V heads are "
                    f"split over the D ranks, or each copied on D / num_kv_heads ranks when fewer)"
                    if name == "num_kv_heads" else f"{key}={degree} does not divide model.{name}={size}")
            raise ValueError(f"{rule}; use one of {_fmt_list(working)}{hint}")


def _scheme_hint(sizes: dict[str, int], degree: int, seq_len: int | None) -> str:
    """The schemes that run this shape at this degree: sp replicates the weights (no weight rule,
    only the zigzag one), tp_x_sp splits them T ways only (T | the query heads and the
    intermediate dim, T a divisor or a multiple of the K/V heads; S = D / T)."""
    weight_gcd, n_kv = math.gcd(sizes["num_heads"], sizes["intermediate_size"]), sizes["num_kv_heads"]

    def zigzag_ok(s: int) -> bool:
        return seq_len is None or seq_len % (2 * s) == 0

    options = []
    if zigzag_ok(degree):
        options.append(f"parallel.scheme=sp (weights replicated) runs parallel.tsp_degree={degree}")
    pairs = [f"{t} x {degree // t}" for t in _divisors(degree)
             if 1 < t < degree and weight_gcd % t == 0 and (n_kv % t == 0 or t % n_kv == 0)
             and zigzag_ok(degree // t)]
    if pairs:
        options.append("parallel.scheme=tp_x_sp with parallel.tp_degree x parallel.sp_degree in "
                       + ", ".join(pairs))
    return f"; or {'; or '.join(options)}" if options else ""


def _check_sequence_split(seq_len: int, key: str, degree: int, *, chunks: int,
                          seq_key: str = "data.seq_len") -> None:
    parts = chunks * degree
    if seq_len % parts == 0:
        return
    why = (f"2 x {key} = {parts} (zigzag cuts each sequence into 2D chunks)" if chunks == 2 else
           f"{key}={degree} (sequence parallelism cuts each sequence into D chunks)")
    lower = seq_len // parts * parts
    nearby = f"{lower} or {lower + parts}" if lower else f"{parts}"
    raise ValueError(f"{seq_key}={seq_len} is not divisible by {why}; use a multiple of {parts}, "
                     f"e.g. {nearby}")


def _check_ulysses_heads(model_cfg: ModelConfig, degree: int) -> None:
    """Ulysses' all-to-all hands each rank n_h / D query heads; K/V heads fewer than D are repeated
    to D (each the same number of times), more are split evenly."""
    n_h, n_kv = model_cfg.num_heads, model_cfg.num_kv_heads
    if n_h % degree:
        raise ValueError(f"parallel.tsp_degree={degree} does not divide model.num_heads={n_h} "
                         f"(parallel.scheme='ulysses' gives each rank num_heads / D query heads); "
                         f"use one of {_fmt_list(_divisors(n_h))}")
    if n_kv % degree and degree % n_kv:
        raise ValueError(f"parallel.tsp_degree={degree} and model.num_kv_heads={n_kv} divide neither "
                         f"way (parallel.scheme='ulysses' splits the K/V heads over D ranks, or repeats "
                         f"each D / num_kv_heads times when fewer); use a multiple or a divisor of {n_kv}")


def ulysses_head_chunk_counts(model_cfg: ModelConfig, degree: int) -> list[int]:
    """The values of parallel.ulysses_head_chunks scheme ulysses runs at degree D: c divides the
    num_heads / D local query heads per rank (each group of num_heads / c query heads goes through
    one all-to-all, so it is a multiple of D); num_kv_heads and c divide one way or the other (a
    group takes the num_kv_heads / c K/V heads its query heads meet, or one it shares), and so do
    num_kv_heads and c D (its all-to-all hands every rank an equal share of them, repeated up to D
    when fewer)."""
    n_h, n_kv = model_cfg.num_heads, model_cfg.num_kv_heads
    if n_h % degree:
        return [1]
    return [c for c in _divisors(n_h // degree)
            if _either_divides(n_kv, c) and _either_divides(n_kv, c * degree)]


def _either_divides(a: int, b: int) -> bool:
    return a % b == 0 or b % a == 0


def check_ulysses_head_chunks(model_cfg: ModelConfig, *, scheme: str, degree: int, head_chunks: Any) -> None:
    """parallel.ulysses_head_chunks: `auto`, or a count ulysses_head_chunk_counts allows (any other
    scheme: 1); the head rules of ulysses itself (_check_ulysses_heads) come first."""
    if head_chunks == "auto":
        return
    _require_setting("parallel.ulysses_head_chunks", head_chunks)
    if scheme != "ulysses":
        if head_chunks != 1:
            raise ValueError(f"parallel.ulysses_head_chunks={head_chunks} is only used by "
                             f"parallel.scheme='ulysses' (got {scheme!r}); set it to 1 or auto")
        return
    n_h, n_kv = model_cfg.num_heads, model_cfg.num_kv_heads
    if n_h % degree or head_chunks in ulysses_head_chunk_counts(model_cfg, degree):
        return
    counts = _fmt_list(ulysses_head_chunk_counts(model_cfg, degree))
    if (n_h // degree) % head_chunks:
        raise ValueError(f"parallel.ulysses_head_chunks={head_chunks} does not divide the "
                         f"model.num_heads / parallel.tsp_degree = {n_h} / {degree} = {n_h // degree} "
                         f"query heads per rank (each chunk's num_heads / chunks query heads go "
                         f"through one all-to-all, a multiple of D); use one of {counts}")
    raise ValueError(f"parallel.ulysses_head_chunks={head_chunks} with model.num_kv_heads={n_kv} and "
                     f"parallel.tsp_degree={degree}: num_kv_heads and chunks, or num_kv_heads and "
                     f"chunks x D = {head_chunks * degree}, divide neither way (each chunk takes the "
                     f"num_kv_heads / chunks K/V heads its query heads meet, or one it shares, and "
                     f"its all-to-all hands every rank an equal share, repeated up to D when fewer); "
                     f"use one of {counts}")


def _check_head_buckets(model_cfg: ModelConfig, degree: int, head_buckets: int) -> None:
    # Buckets split the K/V heads of one weight shard; each bucket has its own K/V all-gather
    # (a shard holds one K/V head, a copy, when they are fewer than D)
    per_shard = max(1, model_cfg.num_kv_heads // degree)
    if per_shard % head_buckets:
        if model_cfg.num_kv_heads < degree:
            raise ValueError(f"parallel.head_buckets={head_buckets} with model.num_kv_heads="
                             f"{model_cfg.num_kv_heads} < parallel.tsp_degree={degree}: each TSP weight "
                             f"shard holds one K/V head (a copy), which cannot be split; use 1")
        raise ValueError(f"parallel.head_buckets={head_buckets} does not divide model.num_kv_heads / "
                         f"parallel.tsp_degree = {model_cfg.num_kv_heads} / {degree} = {per_shard} "
                         f"(K/V heads per TSP weight shard); use one of {_fmt_list(_divisors(per_shard))}")


# ---------------------------------------------------------------------------------------------
# Cross-section rules


def _check_attention_chunk(cfg: TrainConfig) -> None:
    """parallel.attention_chunk_tokens chunks TSP's K/V gathers (parallel/tsp/chunked.py): a count
    with another scheme would be ignored, so it is refused."""
    chunk, scheme = cfg.parallel.attention_chunk_tokens, cfg.parallel.scheme
    if chunk != "auto" and scheme != "tsp":
        raise ValueError(f"parallel.attention_chunk_tokens={chunk} with parallel.scheme={scheme!r}: only "
                         "parallel.scheme='tsp' gathers K/V in chunks; set "
                         "parallel.attention_chunk_tokens=auto")


def _check_tsp_recompute(cfg: TrainConfig) -> None:
    """parallel.tsp_recompute=selective keeps each layer's attention outputs, =none also the MLP's
    gate/up pre-activations (parallel/tsp/attention.py, mlp.py): TSP only, not under activation
    checkpointing (whose replay keeps them for one block in every mode: parallel/tsp/kept.py, so
    only full names it) nor under an offload that would not see them. (The CUDA kernel rules are
    checked by the Trainer, which knows the device.)"""
    mode, scheme = cfg.parallel.tsp_recompute, cfg.parallel.scheme
    if mode in ("full", "auto"):             # auto: plan/auto.py chooses a mode these rules take
        return
    kept = _TSP_KEPT[mode]
    if scheme != "tsp":
        raise ValueError(f"parallel.tsp_recompute={mode!r} with parallel.scheme={scheme!r}: only "
                         "parallel.scheme='tsp' recomputes by shard; set parallel.tsp_recompute=full")
    if cfg.train.activation_checkpointing is True:
        raise ValueError(f"parallel.tsp_recompute={mode!r} with train.activation_checkpointing=true: "
                         f"the checkpoint recomputes the whole layer, and its replay keeps the "
                         f"{kept} {mode} keeps for one block's backward in every mode, so the "
                         "mode changes nothing there; set parallel.tsp_recompute=full, or "
                         "train.activation_checkpointing=false to keep them for every layer")
    if cfg.train.offload_activations is True:
        raise ValueError(f"parallel.tsp_recompute={mode!r} with train.offload_activations=true: the "
                         f"{kept} {mode} keeps are not offloaded (only the blocks' "
                         "saved tensors go to host memory), so every layer's stay on the device; "
                         "set parallel.tsp_recompute=full or train.offload_activations=false")


def _check_nested_checkpoint(cfg: TrainConfig) -> None:
    """train.checkpoint_segment_blocks > 1 nests per-block checkpoints in segment checkpoints
    (model/activation_checkpoint.py): without activation checkpointing there is nothing to nest."""
    k = cfg.train.checkpoint_segment_blocks
    if k != "auto" and k > 1 and cfg.train.activation_checkpointing is False:
        raise ValueError(f"train.checkpoint_segment_blocks={k} with train.activation_checkpointing=false: "
                         "nested checkpointing keeps every k-th block input of checkpointed blocks; "
                         "set train.activation_checkpointing=true (or auto) or "
                         "train.checkpoint_segment_blocks=1")


# what each parallel.tsp_recompute beyond "full" keeps per layer (for the refusals' wording)
_TSP_KEPT = {"selective": "attention outputs",
             "none": "attention outputs and MLP gate/up pre-activations"}


def _check_batch(cfg: TrainConfig, dp_degree: int | None) -> None:
    micro, accum, wanted = cfg.data.micro_batch_size, cfg.train.grad_accum, cfg.train.global_batch_size
    if wanted is None:
        return
    if dp_degree is None:   # world size unknown: only the part that does not depend on it
        if wanted % (micro * accum):
            raise ValueError(f"train.global_batch_size={wanted} is not a multiple of "
                             f"data.micro_batch_size x train.grad_accum = {micro} x {accum}")
        return
    if wanted != micro * accum * dp_degree:
        raise ValueError(f"train.global_batch_size={wanted} is not data.micro_batch_size x "
                         f"train.grad_accum x dp_degree = {micro} x {accum} x {dp_degree} = "
                         f"{micro * accum * dp_degree}; fix one of them or set it to null")


def _check_schedule(cfg: TrainConfig, model: ModelConfig) -> None:
    if cfg.data.seq_len > model.max_seq_len:
        raise ValueError(f"data.seq_len={cfg.data.seq_len} exceeds model.max_seq_len={model.max_seq_len} "
                         f"(RoPE is set up for that many positions); lower data.seq_len or raise "
                         f"model.max_seq_len (with model.rope_scaling to extend a trained context, "
                         "see docs/long_context/rope.md)")
    check_sliding_window(model, cfg.data.seq_len)
    check_exact_positions(cfg.data.seq_len, reset_positions=cfg.data.reset_positions)
    if cfg.optim.min_lr > cfg.optim.lr:
        raise ValueError(f"optim.min_lr={cfg.optim.min_lr} is above optim.lr={cfg.optim.lr}; the "
                         "schedule decays from lr down to min_lr")
    if cfg.optim.lr * cfg.optim.weight_decay >= 1:
        raise ValueError(f"optim.weight_decay={cfg.optim.weight_decay:g} with optim.lr={cfg.optim.lr:g}: "
                         "AdamW scales each decayed weight by 1 - lr * weight_decay per step, so "
                         f"lr * weight_decay must be below 1; lower optim.weight_decay below "
                         f"{1 / cfg.optim.lr:g}")
    if cfg.optim.warmup_steps > cfg.train.steps:
        raise ValueError(f"optim.warmup_steps={cfg.optim.warmup_steps} exceeds train.steps="
                         f"{cfg.train.steps}; warmup must end within the run")
    if cfg.train.eval_every and cfg.data.eval_split is None:
        raise ValueError(f"train.eval_every={cfg.train.eval_every} needs data.eval_split, which is "
                         "null; name an eval split or set train.eval_every=0")


def passkey_lengths(cfg: TrainConfig) -> list[int]:
    """eval.passkey_lengths, or [data.seq_len] when the list is empty."""
    return list(cfg.eval.passkey_lengths) or [cfg.data.seq_len]


def check_eval_length(model: ModelConfig, parallel: ParallelSection, length: int, *, key: str) -> None:
    """An evaluation sequence of `length` tokens must split like a training one under the layout
    (zigzag: 2D chunks; Megatron SP: D blocks) and fit a source model's attention window."""
    check_parallel_shapes(model, scheme=parallel.scheme, degree=parallel.tsp_degree, seq_len=length,
                          head_buckets=shape_buckets(parallel), tp_degree=parallel.tp_degree,
                          sp_degree=parallel.sp_degree, seq_key=key)
    check_sliding_window(model, length, key=key)


def _check_eval(cfg: TrainConfig, model: ModelConfig) -> None:
    e = cfg.eval
    for name, values in (("passkey_lengths", e.passkey_lengths), ("passkey_depths", e.passkey_depths)):
        twice = sorted({v for v in values if list(values).count(v) > 1})
        if twice:
            raise ValueError(f"eval.{name}={list(values)} lists {twice[0]} more than once; "
                             "give each value once")
    if e.passkey_every and not e.passkey_depths:
        raise ValueError(f"eval.passkey_every={e.passkey_every} needs at least one depth in "
                         "eval.passkey_depths (0 = needle at the start, 1 = at the end)")
    for i, depth in enumerate(e.passkey_depths):
        if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0 <= depth <= 1:
            raise ValueError(f"eval.passkey_depths[{i}]={depth!r} must be a number in [0, 1] "
                             "(0 = needle at the start of the haystack, 1 = at its end)")
    for i, length in enumerate(passkey_lengths(cfg) if e.passkey_every else e.passkey_lengths):
        key = f"eval.passkey_lengths[{i}]" if e.passkey_lengths else "data.seq_len"
        _require_setting("data.seq_len", length, key=key)
        check_eval_length(model, cfg.parallel, length, key=key)


def _check_data_sources(cfg: TrainConfig) -> None:
    """Exactly one of data.source / data.sources; formats known (weights: _check_bounds)."""
    d = cfg.data
    if d.sources and d.source is not None:
        raise ValueError(f"data.source={d.source!r} and data.sources (a mixture of "
                         f"{len(d.sources)}) are both set; set data.source=null to train on the "
                         "mixture, or data.sources=[] for one source")
    if not d.sources and d.source is None:
        raise ValueError("data.source is null and data.sources is empty: name the training data")
    formats = typing.get_args(typing.get_type_hints(type(d))["format"])
    names = []
    for i, src in enumerate(d.sources):
        key = f"data.sources[{i}]"
        if src.format not in formats:
            raise ValueError(f"{key}.format={src.format!r} is not one of "
                             f"{', '.join(map(repr, formats))}")
        names.append(src.name or src.source)
    if len(set(names)) != len(names):
        raise ValueError(f"data.sources names {names} repeat; give each source a distinct name")
    if d.eval_source is not None and cfg.train.eval_every and d.eval_split is None:
        raise ValueError("data.eval_source is set but data.eval_split is null; name the split to "
                         "read from it")


def _check_document_masking(cfg: TrainConfig) -> None:
    d = cfg.data
    for key in ("document_masking", "reset_positions"):
        if not isinstance(getattr(d, key), bool):
            raise ValueError(f"data.{key}={getattr(d, key)!r} must be true or false")
    if d.reset_positions and not d.document_masking:
        raise ValueError("data.reset_positions=true needs data.document_masking=true (positions "
                         "restart per document only where attention stops at its boundary)")


def _check_length_schedule(cfg: TrainConfig, model: ModelConfig) -> None:
    """Every stage of data.seq_len_schedule keeps the scheme's sequence rule (2D | seq_len for
    TSP's zigzag) and fits RoPE; stages start at step 0, in order, and end at data.seq_len."""
    stages, d, p = cfg.data.seq_len_schedule, cfg.data, cfg.parallel
    if not stages:
        return
    starts = [st.start_step for st in stages]
    if starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])):
        raise ValueError(f"data.seq_len_schedule start_step values {starts} must begin at 0 and "
                         "increase")
    for i, st in enumerate(stages):
        key = f"data.seq_len_schedule[{i}]"     # (its seq_len and micro_batch_size: _check_bounds)
        if st.start_step >= cfg.train.steps:
            raise ValueError(f"{key}.start_step={st.start_step} is not before train.steps="
                             f"{cfg.train.steps}; the stage would never run")
        if st.seq_len > d.seq_len:
            raise ValueError(f"{key}.seq_len={st.seq_len} exceeds data.seq_len={d.seq_len}, the "
                             "longest sequence the run is planned for; raise data.seq_len")
        try:
            check_parallel_shapes(model, scheme=p.scheme, degree=p.tsp_degree, seq_len=st.seq_len,
                                  head_buckets=shape_buckets(p), tp_degree=p.tp_degree,
                                  sp_degree=p.sp_degree)
        except ValueError as err:
            raise ValueError(str(err).replace("data.seq_len=", f"{key}.seq_len=")) from None
    if stages[-1].seq_len != d.seq_len:
        raise ValueError(f"data.seq_len_schedule ends at seq_len={stages[-1].seq_len} but "
                         f"data.seq_len={d.seq_len}; the last stage must train at data.seq_len")


def _check_paths(cfg: TrainConfig) -> None:
    resume = cfg.train.resume
    if resume not in ("none", "auto") and not os.path.exists(resume):
        raise ValueError(f"train.resume={resume!r} is not 'none', 'auto' or an existing checkpoint "
                         "path; check the path (relative paths start from the working directory)")


# ---------------------------------------------------------------------------------------------
# Helpers


def _divisors(n: int) -> list[int]:
    return sorted({f for d in range(1, math.isqrt(n) + 1) if n % d == 0 for f in (d, n // d)})


def _fmt_list(values: list[int], limit: int = 16) -> str:
    shown = ", ".join(map(str, values[:limit]))
    return shown + (", ..." if len(values) > limit else "")
