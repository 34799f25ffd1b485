"""Per-rank communication of one training step, in the convention of the communication ledger
(parallel/ledger.py): {"op/tag": {"count", "bytes", "group"}}, bytes the payload of each op, P2P
counted at the receiver. Model-parallel ops per micro-step (equal to the ledger exactly), DeepSpeed's
data-parallel gradient synchronisation per optimizer step, and the bytes each op puts on the wire.
"""

from __future__ import annotations

from tsp_trainer.config import ModelConfig
from tsp_trainer.plan.layout import Layout
from tsp_trainer.plan.precision import BF16, Precision
from tsp_trainer.plan.state import param_count


def model_parallel_comm(cfg: ModelConfig, layout: Layout, seq_len: int,
                        prec: Precision = BF16) -> dict[str, dict[str, int]]:
    """Ledger of one forward + backward on one rank (model-parallel ops only), exactly as
    parallel/ledger.py records it, including the forward ops that activation checkpointing
    replays. TSP: `tsp_step_comm`; baselines: `expected_ledger_bytes` (parallel/baselines)."""
    from tsp_trainer.parallel.tsp.comm_model import tsp_step_comm

    e, ew, L, b = prec.act, prec.weight, cfg.num_layers, layout.micro_batch
    out: dict[str, dict[str, int]] = {}

    def add(key: str, count: int, nbytes: int, group: int) -> None:
        if count == 0 and nbytes == 0:
            return
        entry = out.setdefault(key, {"count": 0, "bytes": 0, "group": group})
        entry["count"] += count
        entry["bytes"] += nbytes

    if layout.scheme == "tsp":
        base = tsp_step_comm(cfg, degree=layout.degree, batch=b, seq_len=seq_len,
                             head_buckets=layout.head_buckets, weight_bytes=ew, act_bytes=e)
        for (op, tag), v in base.items():     # kv.grad: over the ranks sharing a K/V head
            add(f"{op}/{tag}", v["count"], v["bytes"],
                cfg.kv_repeat(layout.degree) if tag == "kv.grad" else layout.degree)
        if layout.activation_checkpointing and layout.degree > 1:
            # every block's replay, and the blocks nested checkpointing runs forward once more
            # (each a whole block forward, as the replay)
            d, nb = layout.degree, layout.head_buckets
            n = L + _nested_blocks(cfg, layout)
            p_attn, p_mlp = cfg.attn_shard_params(d), cfg.mlp_sharded_params
            kv_bucket = b * seq_len * 2 * (cfg.kv_shard_hidden(d) // nb) * e
            kv_items = d * nb // cfg.kv_repeat(d)        # one gather per group sharing a K/V head
            add("broadcast/attn.weights", n * d, n * d * p_attn * ew, d)
            add("all_gather/attn.kv", n * kv_items, n * kv_items * kv_bucket, d)
            for op in ("send", "recv"):
                add(f"{op}/mlp.weights", n * (d - 1), n * (d - 1) * (p_mlp // d) * ew, d)
        _kv_in_chunks(out, cfg, layout, seq_len, prec)
        return out
    for key, nbytes, count, group in _baseline_ledger(cfg, layout, seq_len, prec):
        add(key, count, nbytes, group)
    return out


def _kv_in_chunks(out: dict, cfg: ModelConfig, layout: Layout, seq_len: int, prec: Precision) -> None:
    """TSP with K/V in chunks (parallel/tsp/chunked.py): every K/V gather and dK/dV scatter of an
    item is one op per chunk, the same bytes in all; a backward that recomputes the items (full
    recompute without checkpointing, or a replay that keeps nothing) gathers each chunk twice,
    once for the forward's output and log-sum-exp and once for the backward."""
    from tsp_trainer.plan.activations import attention_chunk

    d = layout.degree
    local = seq_len // d
    chunk = attention_chunk(cfg, layout, seq_len, prec, layout.attention_chunk_tokens)
    if d == 1 or chunk >= local:
        return
    chunks = -(-local // chunk)
    for key in ("all_gather/attn.kv", "reduce_scatter/attn.dkv"):
        out[key]["count"] *= chunks
    recomputed = (layout.replay_keeps == "nothing" if layout.activation_checkpointing
                  else layout.tsp_recompute == "full")
    if recomputed:
        items = cfg.num_layers * d * layout.head_buckets
        kv_bucket = layout.micro_batch * seq_len * 2 * (cfg.kv_hidden_size // (d * layout.head_buckets)) * prec.act
        out["all_gather/attn.kv"]["count"] += items * chunks
        out["all_gather/attn.kv"]["bytes"] += items * kv_bucket


def _baseline_ledger(cfg: ModelConfig, layout: Layout, seq_len: int,
                     prec: Precision) -> list[tuple[str, int, int, int]]:
    """(key, bytes, count, group size) of a baseline's forward + backward: the bytes are
    `expected_ledger_bytes`; the counts and the AC replay follow baselines/megatron.py and
    context.py."""
    from tsp_trainer.parallel.baselines.comm_model import expected_ledger_bytes

    t, s_p, seqpar = layout.axes
    kw = {"tp_degree": layout.tp, "sp_degree": layout.sp,
          "tp_sequence_parallel": layout.tp_sequence_parallel} if layout.scheme == "tp_x_sp" else {}
    base = expected_ledger_bytes(cfg, layout.scheme, degree=layout.degree, batch=layout.micro_batch,
                                 seq_len=seq_len, dtype_bytes=prec.act, sharded_weights=layout.zero_stage == 3, **kw)
    per_op_counts = _baseline_op_counts(cfg)
    rows = []
    for key, nbytes in base.items():
        group = s_p if key.endswith((".kv", ".dkv", "wgrad", "loss.count")) else t
        if key == "all_reduce/kv.grad":                 # the tp ranks sharing a K/V head
            group = cfg.kv_repeat(t)
        if key in ("all_reduce/norm.grad", "all_reduce/bias.grad"):
            group = layout.degree if (seqpar and s_p > 1) else (s_p if s_p > 1 else t)
        rows.append((key, nbytes, per_op_counts[key], group))
    if layout.activation_checkpointing:
        rows += _baseline_ac_replay(cfg, layout, seq_len, prec)
        rows += _baseline_nested_forward(cfg, layout, seq_len, prec)
    return rows


def _nested_blocks(cfg: ModelConfig, layout: Layout) -> int:
    """Blocks nested checkpointing runs forward once more per micro-step (0 without it)."""
    return layout.nested_forward_blocks(cfg.num_layers) if layout.activation_checkpointing else 0


def _baseline_nested_forward(cfg: ModelConfig, layout: Layout, seq_len: int,
                             prec: Precision) -> list[tuple[str, int, int, int]]:
    """(key, bytes, count, group size) of the whole block forwards nested checkpointing re-runs:
    per block the forward's region ops (one each) and context attention's K/V all-gather."""
    n = _nested_blocks(cfg, layout)
    if n == 0:
        return []
    t, s_p, seqpar = layout.axes
    e, b, h = prec.act, layout.micro_batch, cfg.hidden_size
    a = b * seq_len // s_p * h * e                          # one region activation [n_r, h]
    kv = b * seq_len * 2 * (cfg.kv_hidden_size // t) * e
    rows = []
    if t > 1 and seqpar:
        rows += [(f"{op}/{part}.tp", n * a, n, t) for part in ("attn", "mlp")
                 for op in ("all_gather", "reduce_scatter")]
    elif t > 1:
        rows += [("all_reduce/attn.tp", n * a, n, t), ("all_reduce/mlp.tp", n * a, n, t)]
    if s_p > 1:
        rows.append(("all_gather/attn.kv", n * kv, n, s_p))
    return rows


def _baseline_op_counts(cfg: ModelConfig) -> dict[str, int]:
    """Ops per forward + backward of each baseline ledger key (baselines/megatron.py, context.py)."""
    L = cfg.num_layers
    return {
        "all_reduce/attn.tp": 2 * L, "all_reduce/mlp.tp": 2 * L, "all_reduce/embed.tp": 1,
        "all_reduce/head.tp": 1, "all_gather/attn.tp": 2 * L, "reduce_scatter/attn.tp": 2 * L,
        "all_gather/mlp.tp": 2 * L, "reduce_scatter/mlp.tp": 2 * L, "all_gather/embed.tp": 1,
        "reduce_scatter/embed.tp": 1, "all_gather/head.tp": 1, "reduce_scatter/head.tp": 1,
        "all_reduce/head.ce": 3, "all_gather/attn.kv": 2 * L, "reduce_scatter/attn.dkv": L,
        "all_reduce/loss.count": 1, "all_reduce/norm.grad": 2 * L + 1,
        # one all-reduce per replicated weight use: 7 per layer + embedding + head, + each bias
        # that is split with its weight (q, k, v; gate, up)
        "all_reduce/wgrad": 7 * L + 2 + L * (3 * int(cfg.qkv_bias) + 2 * int(cfg.mlp_bias)),
        "all_reduce/bias.grad": L * (int(cfg.o_bias) + int(cfg.mlp_bias)),
        # K/V heads fewer than T: one per K/V head copy (weights, and biases with q/k/v biases)
        "all_reduce/kv.grad": 2 * L * (1 + int(cfg.qkv_bias)),
    }


def _baseline_ac_replay(cfg: ModelConfig, layout: Layout, seq_len: int,
                        prec: Precision) -> list[tuple[str, int, int, int]]:
    """(key, bytes, count, group size) of the forward ops activation checkpointing replays: with
    early-stopping recompute a checkpointed block replays its forward only up to the last saved
    tensor, the attention's region exit but not the MLP's."""
    t, s_p, seqpar = layout.axes
    e, L, b, h = prec.act, cfg.num_layers, layout.micro_batch, cfg.hidden_size
    a = b * seq_len // s_p * h * e                          # one region activation [n_r, h]
    kv = b * seq_len * 2 * cfg.kv_shard_hidden(t) * e
    rows = []
    if t > 1 and seqpar:
        rows += [("all_gather/attn.tp", L * a, L, t), ("reduce_scatter/attn.tp", L * a, L, t),
                 ("all_gather/mlp.tp", L * a, L, t)]
    elif t > 1:
        rows.append(("all_reduce/attn.tp", L * a, L, t))
    if s_p > 1:
        rows.append(("all_gather/attn.kv", L * kv, L, s_p))
    return rows


def data_parallel_comm(cfg: ModelConfig, layout: Layout, prec: Precision = BF16) -> dict[str, dict[str, int]]:
    """DeepSpeed's gradient synchronisation over DP per optimizer step (payload, ledger convention):
    gradients move in fp32 (`communication_data_type`). Stage 0, and bf16 with stage 1 (DeepSpeed's
    BF16_Optimizer), all-reduce them; otherwise stages 1 and 2 reduce-scatter them; stages 1 and 2
    all-gather the updated parameters after the step. Plus the trainer's per-micro-step loss
    scalars."""
    if layout.zero_stage == 3:
        return _zero3_comm(cfg, layout, prec)
    if layout.dp == 1:
        return {}
    n = param_count(cfg, layout)
    grads = n * prec.grad_reduce
    out = {}
    if layout.zero_stage == 0 or (layout.zero_stage == 1 and prec.grad_accum):
        out["all_reduce/dp.grads"] = {"count": 1, "bytes": grads, "group": layout.dp}
    else:
        out["reduce_scatter/dp.grads"] = {"count": 1, "bytes": grads, "group": layout.dp}
    if layout.zero_stage >= 1:
        out["all_gather/dp.params"] = {"count": 1, "bytes": n * prec.weight, "group": layout.dp}
    out["all_reduce/loss.dp"] = {"count": 2 * layout.grad_accum, "bytes": 16 * layout.grad_accum,
                                 "group": layout.dp}
    return out


def _zero3_comm(cfg: ModelConfig, layout: Layout, prec: Precision) -> dict[str, dict[str, int]]:
    """ZeRO-3 over all W = D x dp ranks (sp, ulysses; parallel/sharded_weights.py) per optimizer
    step: every micro-step gathers the weights for the forward, again for the backward (and for a
    checkpointed replay) and reduce-scatters the fp32 gradients; plus the loss scalars over dp."""
    out = {}
    n, w, ga = param_count(cfg, layout), layout.world, layout.grad_accum
    if w > 1:
        gathers = ga * (2 + int(layout.activation_checkpointing))
        out["all_gather/zero3.params"] = {"count": gathers, "bytes": gathers * n * prec.weight, "group": w}
        out["reduce_scatter/zero3.grads"] = {"count": ga, "bytes": ga * n * prec.grad_reduce, "group": w}
    if layout.dp > 1:
        out["all_reduce/loss.dp"] = {"count": 2 * ga, "bytes": 16 * ga, "group": layout.dp}
    return out


# bytes a rank receives per op, as a fraction of the ledger payload, for ring / pipelined
# algorithms on g ranks (rooted ops averaged over the ranks; P2P: the received tensor).
WIRE_FACTOR = {"all_reduce": lambda g: 2 * (g - 1) / g, "all_gather": lambda g: (g - 1) / g,
               "reduce_scatter": lambda g: (g - 1) / g, "broadcast": lambda g: (g - 1) / g,
               "reduce": lambda g: (g - 1) / g, "recv": lambda g: 1.0, "send": lambda g: 0.0}


def wire_bytes(entries: dict[str, dict[str, int]]) -> dict[str, float]:
    """{"op/tag": bytes received per rank} of ledger-style entries."""
    return {k: v["bytes"] * WIRE_FACTOR[k.split("/")[0]](v["group"]) for k, v in entries.items()
            if v["group"] > 1}


__all__ = ["WIRE_FACTOR", "data_parallel_comm", "model_parallel_comm", "wire_bytes"]
