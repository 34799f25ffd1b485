"""Closed-form communication of one TSP forward + backward, per rank, in the ledger's terms
(payload bytes per op kind and tag; see parallel/ledger.py for what "payload" means per op).
Tests assert that the ledger of the real code equals this exactly; docs/parallelism.md states the
same formulas; the planner builds on them.

Notation: D degree, B micro-batch, S sequence length, h hidden, h_kv = n_kv * head_dim,
I intermediate, V vocab, L layers, n_b head buckets, b_w / b_a bytes per weight / activation
element, b_g = 4: gradients are reduced and carried in fp32 whatever the weights' dtype
(GRAD_BYTES). P_attn = 2 h^2 + 2 h h_kv (+ h + 2 h_kv with q/k/v biases) and P_mlp = 3 h I (+ 2 I
with gate/up biases) per layer: what one packed shard carries (ModelConfig.attn_sharded_params,
mlp_sharded_params). The replicated weights (2 L + 1 norms, and n_rb L o_proj / down_proj biases)
have their gradients summed in one flattened fp32 all-reduce per backward ("replicated.grad").

K/V heads fewer than D (r = D / n_kv ranks share each, ModelConfig.kv_repeat): a shard holds n_h / D
query heads and a copy of one K/V head (ModelConfig.attn_shard_params), the K/V all-gather and
dK/dV reduce-scatter run once per sharing group, D / r = n_kv times per pass, one head each, and
the copies' gradients (2 L (h d + d with biases)) are summed over the r sharers in one fp32
all-reduce per backward ("kv.grad").
"""

from __future__ import annotations

import collections

from tsp_trainer.config import ModelConfig
from tsp_trainer.config.model import padded_vocab_size
from tsp_trainer.parallel.grad_sync import GRAD_BYTES, KV_GRAD_TAG, REPLICATED_GRAD_TAG


def tsp_step_comm(cfg: ModelConfig, *, degree: int, batch: int, seq_len: int, head_buckets: int = 1,
                  weight_bytes: int = 4, act_bytes: int = 4,
                  loss_count_reduces: int = 1) -> dict[tuple[str, str], dict[str, int]]:
    """{(op, tag): {"count": n, "bytes": payload}} for one forward + backward on one rank."""
    d, nb = degree, head_buckets
    out: dict = collections.defaultdict(lambda: {"count": 0, "bytes": 0})
    if d == 1:
        return {}

    def add(op, tag, count, nbytes_each):
        out[(op, tag)]["count"] += count
        out[(op, tag)]["bytes"] += count * nbytes_each

    h, L, repeat = cfg.hidden_size, cfg.num_layers, cfg.kv_repeat(d)
    h_kv = cfg.kv_shard_hidden(d)                                     # K/V channels of one shard
    p_attn, p_mlp = cfg.attn_shard_params(d), cfg.mlp_sharded_params
    kv_bucket = batch * seq_len * 2 * (h_kv // nb) * act_bytes   # gathered K and V, one bucket
    kv_items = d * nb // repeat                # once per group of owners sharing a K/V head
    for _ in range(L):
        # attention: owner r's packed shard broadcast in forward and again in backward
        add("broadcast", "attn.weights", 2 * d, p_attn * weight_bytes)
        add("all_gather", "attn.kv", 2 * kv_items, kv_bucket)    # forward + recompute in backward
        add("reduce_scatter", "attn.dkv", kv_items, kv_bucket)
        add("reduce", "attn.wgrad", d, p_attn * GRAD_BYTES)
        # MLP: D-1 hops forward, D-1 weight hops + D accumulator hops backward
        for op in ("send", "recv"):
            add(op, "mlp.weights", 2 * (d - 1), p_mlp // d * weight_bytes)
            add(op, "mlp.weights.grad", d, p_mlp // d * GRAD_BYTES)
    vocab_rows = padded_vocab_size(cfg.vocab_size, d) // d            # padded to a multiple of D
    vocab_shard = vocab_rows * h * weight_bytes
    vocab_grad = vocab_rows * h * GRAD_BYTES
    for op in ("send", "recv"):
        add(op, "embed.weights", d - 1, vocab_shard)             # backward moves accumulators only
        add(op, "embed.weights.grad", d, vocab_grad)
        add(op, "head.weights", 2 * (d - 1), vocab_shard)
        add(op, "head.weights.grad", d, vocab_grad)
    replicated_biases = int(cfg.o_bias) + int(cfg.mlp_bias)
    head_norms = 2 * L * cfg.head_dim if cfg.qk_norm else 0     # q_norm, k_norm [head_dim] per layer
    add("all_reduce", REPLICATED_GRAD_TAG, 1,
        ((2 * L + 1 + replicated_biases * L) * h + head_norms) * GRAD_BYTES)
    if repeat > 1:                      # the K/V head copies' weights and biases, per layer
        add("all_reduce", KV_GRAD_TAG, 1, L * 2 * h_kv * (h + int(cfg.qkv_bias)) * GRAD_BYTES)
    if loss_count_reduces:
        add("all_reduce", "loss.count", loss_count_reduces, 8)     # float64 token count
    return {k: dict(v) for k, v in out.items()}


def ledger_totals(records) -> dict[tuple[str, str], dict[str, int]]:
    """The ledger's records in the same form as tsp_step_comm."""
    out: dict = collections.defaultdict(lambda: {"count": 0, "bytes": 0})
    for r in records:
        out[(r.op, r.tag)]["count"] += 1
        out[(r.op, r.tag)]["bytes"] += r.nbytes
    return {k: dict(v) for k, v in out.items()}
