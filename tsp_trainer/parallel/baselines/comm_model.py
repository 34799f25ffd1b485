"""Closed-form communication of the baselines: the ledger bytes one rank records for one forward +
backward of `Transformer.loss_sum` plus the global token count (parallel/loss.py), keyed "op/tag"
like `CommLedger.summary()`. Payload conventions are the ledger's (ledger.py): all-gather counts the
gathered output, reduce-scatter the full input, all-reduce the buffer.

Notation: T = tp size, S = sp size, L layers, B micro-batch, N = seq_len, h hidden, h_kv = n_kv * d,
I intermediate, V vocabulary, e bytes per activation/parameter element (4 in fp32).
n = B N / S tokens are in a TP region on each rank; a = n h e is one such activation.

  TP (T > 1):      all-reduce  attn.tp, mlp.tp: 2 L a each (forward leave + backward enter),
                               embed.tp: a (forward), head.tp: a (backward)
  TP + SP:         all-gather and reduce-scatter attn.tp, mlp.tp: 2 L a each;
                               embed.tp, head.tp: a each
  both:            all-reduce  head.ce: 3 n x 4 B (fp32 max, target logit, sum-exp)
  SP (S > 1):      all-gather  attn.kv: 2 L x B N 2 (h_kv / T) e (forward + backward re-gather)
                   reduce-scatter attn.dkv: L x B N 2 (h_kv / T) e
                   all-reduce  wgrad: (L (P_attn + P_mlp) + 2 V h) / T x 4, P_attn = 2h^2 +
                               2 h h_kv (+ h + 2 h_kv q/k/v biases), P_mlp = 3 h I (+ 2 I gate/up
                               biases) (every non-norm weight once, in fp32; a tied table twice:
                               once per use)
                   all-reduce  loss.count: 8 B (fp64 token count)
  norms:           all-reduce  norm.grad: (2L + 1) h 4 (fp32) when the norm inputs are split over ranks
                               (TP+SP: over tp; SP: over sp; TP x SP: over sp, or over all D
                               ranks with tp_sequence_parallel)
  o/down biases:   all-reduce  bias.grad: L h 4 (fp32) per replicated bias (o_proj, down_proj),
                               over the same groups as the norms

Per rank and step the TP traffic is 4 L a ~ 4 L B N h e / S (independent of T, as in section 5.1 of
the TSP paper, https://arxiv.org/abs/2604.26294, where the (T-1)/T factor counts the bytes that
actually cross links), and the SP traffic 3 L B N 2 h_kv e / T + 4 P / T: bytes grow with N for
every baseline.
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
    if scheme == "sp":
        return 1, degree, False
    if scheme == "tp_x_sp":
        assert tp_degree * sp_degree == degree, "tp_degree x sp_degree must equal the degree"
        return tp_degree, sp_degree, bool(tp_sequence_parallel)
    raise ValueError(f"parallel.scheme={scheme!r} is not a baseline; use tp, tp_sp, sp or tp_x_sp")


def expected_ledger_bytes(cfg: ModelConfig, scheme: str, *, degree: int, batch: int, seq_len: int,
                          tp_degree: int | None = None, sp_degree: int | None = None,
                          tp_sequence_parallel: bool = False, dtype_bytes: int = 4) -> dict[str, int]:
    """Ledger bytes per "op/tag" on one rank for one forward + backward (see the module docstring)."""
    t, s, seq_par = scheme_axes(scheme, degree, tp_degree, sp_degree, tp_sequence_parallel)
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
    if s > 1:
        kv = batch * seq_len * 2 * (cfg.kv_hidden_size // t) * e
        out["all_gather/attn.kv"] += 2 * layers * kv
        out["reduce_scatter/attn.dkv"] += layers * kv
        per_layer = cfg.attn_sharded_params + cfg.mlp_sharded_params
        vocab = padded_vocab_size(cfg.vocab_size, t)              # padded to a multiple of T
        out["all_reduce/wgrad"] += (layers * per_layer + 2 * vocab * h) // t * GRAD_BYTES
        out["all_reduce/loss.count"] += 8
    if t * s > 1 and cfg.qk_norm:     # q_norm, k_norm: other heads or tokens on every rank of the group
        out["all_reduce/norm.grad"] += layers * cfg.head_norm_params * GRAD_BYTES
    norms_split = (s > 1) or (seq_par and t > 1)
    if norms_split:
        out["all_reduce/norm.grad"] += (2 * layers + 1) * h * GRAD_BYTES
        if cfg.replicated_biases:
            out["all_reduce/bias.grad"] += layers * cfg.replicated_biases * GRAD_BYTES
    return dict(out)


def bytes_by_op(by_tag: dict[str, int]) -> dict[str, int]:
    """Collapse "op/tag" keys to op kinds."""
    out: dict[str, int] = collections.defaultdict(int)
    for key, nbytes in by_tag.items():
        out[key.split("/")[0]] += nbytes
    return dict(out)
