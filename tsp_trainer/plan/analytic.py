"""Analytic per-rank model of one training step for every scheme: memory (parameters, gradients,
AdamW state, saved activations, transient buffers), communication (bytes per op, tag and link),
FLOPs, and a predicted step time / tokens/s / MFU under an explicit overlap model.

Everything is per rank and in bytes unless a name says otherwise. docs/planner.md derives each term;
tests check the memory against the real code (CPU benchmark, fake-tensor dry run) and the
communication against the ledger exactly.

Notation: L layers, h hidden, h_kv = n_kv * d, I intermediate, V vocab, n_h heads, B micro-batch
(sequences), S sequence length. A layout has model-parallel degree D = T x S_p (T splits weights, S_p
splits tokens; TSP splits both D ways), DP replicas, a ZeRO stage, activation checkpointing (AC) on
or off, n_b head buckets (TSP), grad_accum micro-steps per optimizer step.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from tsp_trainer.config import ModelConfig
from tsp_trainer.model.rms_norm import backward_chunk_rows
from tsp_trainer.observability.flops import (attention_flops_per_token, block_matmul_params,
                                             flops_per_token)
from tsp_trainer.plan.hardware import HardwareProfile

SCHEMES = ("tsp", "tp", "tp_sp", "sp", "tp_x_sp")
TSP_RECOMPUTE = ("full", "selective", "none")   # parallel.tsp_recompute (parallel/tsp/)


# the short marker of a tsp_recompute other than full in layout labels and tables
RECOMPUTE_MARK = {"selective": "sel", "none": "keep"}

# ---------------------------------------------------------------------------------------------
# inputs


@dataclass(frozen=True)
class Precision:
    """Bytes per element. bf16 mixed precision (DeepSpeed bf16, the ZeRO paper's accounting):
    bf16 weights, gradients and activations, an fp32 master copy and two fp32 Adam moments
    (2 + 2 + 12 = 16 bytes per parameter before ZeRO), plus the fp32 gradient accumulation the
    trainer configures (engine/deepspeed.py: data_types.grad_accum_dtype=fp32): `grad_accum` bytes
    per parameter beside the bf16 gradient (ZeRO-1: DeepSpeed's BF16_Optimizer keeps a full fp32
    buffer; ZeRO-2: an fp32 partition), and gradients reduced over DP in fp32 (`grad_reduce`).
    fp32 (CPU runs, tests): no master copy, the gradient is its own accumulator."""

    name: str
    weight: int
    grad: int
    act: int
    master: int
    moments: int
    grad_accum: int = 0          # fp32 accumulation buffer per parameter (0: the gradient itself)
    grad_reduce: int = 4         # bytes per element of the DP gradient reduction (fp32)

    @property
    def optimizer(self) -> int:
        return self.master + self.moments

    @property
    def zero_stages(self) -> tuple[int, ...]:
        """ZeRO stages the trainer runs with this precision: bf16 needs 1 or 2 (DeepSpeed
        accumulates bf16 gradients in fp32 only under ZeRO; config/validate.py refuses stage 0)."""
        return (1, 2) if self.grad_accum else (0, 1, 2)


BF16 = Precision("bf16", weight=2, grad=2, act=2, master=4, moments=8, grad_accum=4)
FP32 = Precision("fp32", weight=4, grad=4, act=4, master=0, moments=8)
PRECISIONS = {"bf16": BF16, "fp32": FP32}


@dataclass(frozen=True)
class Layout:
    """How one job is laid out. `degree` is D, the model-parallel group (the mesh's inner axis);
    for tp_x_sp, tp x sp = D."""

    scheme: str
    degree: int
    dp: int = 1
    tp: int | None = None                  # tp_x_sp only
    sp: int | None = None                  # tp_x_sp only
    tp_sequence_parallel: bool = False     # tp_x_sp only: Megatron SP inside the tp sub-axis
    zero_stage: int = 1
    activation_checkpointing: bool = False
    head_buckets: int = 1                  # tsp only
    micro_batch: int = 1                   # sequences per replica per micro-step
    grad_accum: int = 1
    offload_activations: bool = False      # blocks' saved tensors in host memory (model/offload.py)
    tsp_recompute: str = "full"            # tsp only: "selective" keeps q, k/v, attention outputs;
                                           # "none" also the MLP's gate/up pre-activations

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"scheme={self.scheme!r} is not one of {', '.join(SCHEMES)}")
        self._check_recompute()
        if self.zero_stage not in (0, 1, 2):
            raise ValueError(f"zero_stage={self.zero_stage} must be 0, 1 or 2")
        if self.scheme == "tp_x_sp":
            t, s, _ = self.axes
            if t * s != self.degree:
                raise ValueError(f"tp x sp = {t} x {s} is not the degree {self.degree}")

    def _check_recompute(self) -> None:
        """The trainer's rules (config/validate.py::_check_tsp_recompute), so that no layout the
        planner offers is one the trainer refuses."""
        mode = self.tsp_recompute
        if mode not in TSP_RECOMPUTE:
            raise ValueError(f"tsp_recompute={mode!r} is not one of {', '.join(TSP_RECOMPUTE)}")
        if mode == "full":
            return
        if self.scheme != "tsp":
            raise ValueError(f"tsp_recompute={mode!r} with scheme {self.scheme!r}: only tsp "
                             "recomputes by shard; use tsp_recompute='full'")
        if self.activation_checkpointing or self.offload_activations:
            raise ValueError(f"tsp_recompute={mode!r} with "
                             f"{'activation checkpointing' if self.activation_checkpointing else 'activation offload'}: "
                             "the trainer refuses it (the kept attention outputs would stay on the "
                             "device for every layer); use tsp_recompute='full'")

    @property
    def selective(self) -> bool:
        """tsp_recompute == "selective" exactly (the attention kept, the MLP recomputed)."""
        return self.tsp_recompute == "selective"

    @property
    def keeps_attention(self) -> bool:
        """TSP keeps each item's q, k/v, attention output and log-sum-exp (selective and none):
        backward re-runs neither the q/k/v projections nor the attention forward."""
        return self.scheme == "tsp" and self.tsp_recompute in ("selective", "none")

    @property
    def keeps_mlp(self) -> bool:
        """TSP keeps every ring step's gate/up pre-activations (none): backward re-runs no
        gate/up GEMM."""
        return self.scheme == "tsp" and self.tsp_recompute == "none"

    @property
    def axes(self) -> tuple[int, int, bool]:
        """(T, S_p, Megatron SP): weight split, token split, sequence-parallel TP regions."""
        d = self.degree
        if self.scheme == "tsp":
            return d, d, False
        if self.scheme == "tp":
            return d, 1, False
        if self.scheme == "tp_sp":
            return d, 1, d > 1
        if self.scheme == "sp":
            return 1, d, False
        if self.tp is None or self.sp is None:
            raise ValueError("scheme tp_x_sp needs tp and sp (tp x sp = degree)")
        return self.tp, self.sp, self.tp_sequence_parallel and self.tp > 1

    @property
    def world(self) -> int:
        return self.degree * self.dp

    def label(self) -> str:
        name = self.scheme
        if self.scheme == "tp_x_sp":
            name = f"tp{self.tp}xsp{self.sp}" + ("+seqpar" if self.tp_sequence_parallel else "")
        parts = [name, f"D={self.degree}", f"DP={self.dp}", f"Z{self.zero_stage}",
                 "AC" if self.activation_checkpointing else "noAC"]
        if self.scheme == "tsp":
            parts.append(f"nb={self.head_buckets}")
            if self.tsp_recompute != "full":
                parts.append(RECOMPUTE_MARK[self.tsp_recompute])
        parts.append(f"mb={self.micro_batch}x{self.grad_accum}")
        if self.offload_activations:
            parts.append("offload")
        return " ".join(parts)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Assumptions:
    """The planner's free parameters (docs/planner.md section 4 explains each)."""

    compute_efficiency: float = 0.45       # achieved fraction of peak FLOP/s (GEMMs + attention)
    comm_efficiency: float = 0.75          # achieved fraction of link bandwidth (bus bandwidth)
    hbm_usable: float = 0.92               # of HBM, for tensors (allocator slack, NCCL/RCCL, context)
    op_latency_s: float = 15e-6            # fixed cost of one collective / P2P op (launch + sync)


# ---------------------------------------------------------------------------------------------
# parameters, gradients, optimizer state


def param_count(cfg: ModelConfig, layout: Layout) -> int:
    """Parameters held by one rank: the matrices and the q/k/v, gate/up biases split over T (heads,
    intermediate block, vocab rows), norms and the o_proj / down_proj biases replicated
    (parallel/apply.py TSP_PLAN, baselines/apply.py: the same plan)."""
    t, _, _ = layout.axes
    h, L = cfg.hidden_size, cfg.num_layers
    split = (L * (cfg.attn_sharded_params + cfg.mlp_sharded_params)
             + cfg.vocab_size * h * (1 if cfg.tie_embeddings else 2))
    return split // t + (2 * L + 1) * h + L * cfg.replicated_biases


def state_bytes(cfg: ModelConfig, layout: Layout, prec: Precision = BF16) -> dict[str, int]:
    """Per-rank parameter, gradient and optimizer bytes. ZeRO shards over DP (the ranks holding the
    same shard): stage 1 the fp32 master + moments, stage 2 also the gradients."""
    n = param_count(cfg, layout)
    dp = layout.dp
    opt = n * prec.optimizer
    if layout.zero_stage >= 1:
        opt = math.ceil(opt / dp)
    return {"params": n * prec.weight, "grads": grad_bytes(n, layout.zero_stage, dp, prec),
            "optimizer": opt, "param_count": n}


def grad_bytes(n: int, zero_stage: int, dp: int, prec: Precision = BF16) -> int:
    """Gradient memory per rank for n parameters: stage 0 the gradients in the weights' dtype (bf16
    with stage 0 accumulates in bf16: modelled, but refused by the trainer); stage 1 the gradients
    plus the full fp32 accumulation buffer (BF16_Optimizer); stage 2 the fp32 partition (the bf16
    gradients are freed bucket by bucket as they are reduced)."""
    if zero_stage == 0:
        return n * prec.grad
    if zero_stage == 1:
        return n * (prec.grad + prec.grad_accum)
    return math.ceil(n * (prec.grad_accum or prec.grad) / dp)


# ---------------------------------------------------------------------------------------------
# activations


@dataclass
class ActivationEstimate:
    stored_per_layer: int          # saved between forward and backward, per layer (AC: block input)
    stored_outside: int            # final norm, loss, RoPE tables
    stored: int                    # at the end of the forward (all layers + outside)
    phases: dict[str, int]         # peak live bytes in each phase of the step
    peak: int
    peak_phase: str
    terms: dict[str, int] = field(default_factory=dict)   # named pieces, for the docs and JSON
    host: int = 0                  # offloaded to host memory (train.offload_activations)


def _tokens(layout: Layout, seq_len: int) -> dict[str, int]:
    """Tokens per rank in each region of a layer."""
    t, s, seqpar = layout.axes
    b = layout.micro_batch
    if layout.scheme == "tsp":
        n = b * seq_len // layout.degree
        return {"region": n, "norm": n, "rope": seq_len // layout.degree}
    region = b * seq_len // s                     # tokens entering the TP matmuls
    return {"region": region, "norm": region // t if seqpar else region, "rope": seq_len // s}


def activation_memory(cfg: ModelConfig, layout: Layout, seq_len: int, prec: Precision = BF16, *,
                      device: str = "cuda") -> ActivationEstimate:
    """Saved activations and the peak of saved + transient bytes over one forward + backward.

    Derived from what the code keeps (docs/planner.md section 2): RMSNorm saves its input in fp32,
    the normalised input and (when the next op keeps it) its output; TSP attention and MLP save only
    X_p; the baselines keep what autograd keeps around F.linear / SDPA / SiLU. The transient peak is
    the largest of the phases listed in `phases`, for the rank with the largest causal prefix.

    device: "cuda" (what the planner predicts: `attention_core` passes a lower-right CausalBias, no
    mask in memory) or "cpu" (the validation runs: prefix and diagonal merged by log-sum-exp, no
    mask either; the two differ in the K/V expansion of the CUDA memory-efficient kernel).
    """
    e = prec.act
    t, s_p, seqpar = layout.axes
    h, hkv, inter, V, L = (cfg.hidden_size, cfg.kv_hidden_size, cfg.intermediate_size,
                           cfg.vocab_size, cfg.num_layers)
    nh, d = cfg.num_heads, cfg.head_dim
    tok = _tokens(layout, seq_len)
    n_r, n_n = tok["region"], tok["norm"]
    tsp = layout.scheme == "tsp"
    p_attn = cfg.attn_sharded_params                             # W_q, W_k, W_v, W_o (+ q/k/v biases)

    def norm_saved(tokens: int, output_kept: bool) -> int:
        # RmsNormFn (model/rms_norm.py) saves its input x (activation dtype) and rstd [tokens, 1]
        # fp32; plus the output when the consumer saves it.
        return (e + (e if output_kept else 0)) * tokens * h + 4 * tokens

    rope = 2 * tok["rope"] * d * 4                               # fp32 cos, sin tables
    sel = tsp_selective_saved(cfg, layout, seq_len, prec)       # 0 unless selective or none
    mlp_kept = tsp_mlp_kept(cfg, layout, seq_len, prec)         # 0 unless none
    if sel and _kv_expansion(e, device, nh != cfg.num_kv_heads):
        raise ValueError(f"tsp_recompute={layout.tsp_recompute!r} on CUDA in fp32 with GQA: the "
                         "memory-efficient kernel saves expanded K/V copies, which the trainer refuses "
                         "(parallel/tsp/recompute_rules.py); use bf16 or tsp_recompute='full'")
    terms: dict[str, int] = {"rope_tables": rope, "tsp_selective_kept": sel, "tsp_mlp_kept": mlp_kept}

    # ---- saved per layer (no AC) and outside the layers
    if tsp:
        layer = 2 * norm_saved(n_n, True) + sel + mlp_kept
        outside = norm_saved(n_n, True) + 4 * n_r * 3          # final norm; lse, target, loss
    else:
        layer = 2 * norm_saved(n_n, not seqpar)
        if seqpar:
            layer += 2 * e * n_r * h                             # gathered norm output (all tokens)
        q_out = 2 * e * n_r * (h // t)                           # q and the attention output
        kv = 2 * e * n_r * (hkv // t)
        lse = 4 * (nh // t) * n_r if s_p == 1 else 0             # SDPA logsumexp (not recomputed)
        layer += q_out + kv + lse + 4 * e * n_r * (inter // t)  # gate, silu, up, product
        if e != 4:                                               # apply_rope's cos/sin cast to the
            layer += 2 * tok["rope"] * d * e                     # activation dtype, kept by autograd
        outside = norm_saved(n_n, not seqpar) + (e * n_r * h if seqpar else 0)
        outside += 4 * n_r * (V // t) + 4 * n_r * 4              # fp32 softmax block kept by the CE
        outside += 3 * n_r       # per-token loss bookkeeping (3 B/token, measured on fake tensors)
    outside += rope
    ac = layout.activation_checkpointing
    ac_input = e * n_n * h                                       # checkpoint keeps the block input
    if not tsp:          # + an fp32 [n_r] per checkpointed baseline block (measured, fake tensors)
        ac_input += 4 * n_r
    per_layer = ac_input if ac else layer
    # GPU-resident layers' saved tensors: all of them, or with offload (model/offload.py) one block
    # in forward (its copy to host draining) and two in backward (the block being backpropagated
    # and the one prefetched); the host holds every layer's
    offload = layout.offload_activations
    res_fwd = min(L, 1) * per_layer if offload else L * per_layer
    res_bwd = min(L, 2) * per_layer if offload else L * per_layer
    host = L * per_layer if offload else 0
    stored = res_fwd + outside
    terms.update(layer_saved_no_ac=layer, ac_block_input=ac_input, host_offloaded=host)

    # ---- transients (bytes alive in a phase on top of what earlier layers saved)
    if tsp:
        tr = _tsp_transients(cfg, layout, seq_len, prec, tok, p_attn, norm_saved, device, sel, mlp_kept)
    else:
        tr = _baseline_transients(cfg, layout, seq_len, prec, tok, norm_saved, layer, device)
    terms.update({f"transient_{k}": v for k, v in tr.items()})

    below = res_fwd - per_layer + (per_layer if offload and L > 1 else 0) + rope   # before the last
    # under AC the recomputed first norm saves the checkpointed block input itself (one tensor);
    # TSP's backward peak sees that sharing, the baselines' peak comes while a second block-input
    # sized tensor (the incoming gradient's region copy) is alive (measured on fake tensors)
    shared = e * n_n * h if (ac and tsp) else 0
    phases = {}
    if ac:
        # forward: no saved tensors inside a checkpointed block; backward: the block is recomputed
        # (its saved tensors come back) and then backpropagated
        phases["forward"] = below + max(tr["attn_fwd_nograd"], tr["mlp_fwd_nograd"])
        phases["backward"] = res_bwd + rope + max(tr["attn_bwd"], tr["mlp_bwd"]) - shared
    else:
        phases["forward"] = below + max(tr["attn_fwd"], tr["mlp_fwd"])
        phases["backward"] = res_bwd + rope - layer + max(tr["attn_bwd"], tr["mlp_bwd"])
    phases["loss"] = res_fwd + outside + tr["head"]
    # RMSNorm's backward (RmsNormFn): dx in the activation dtype plus the fp32 temporaries of one
    # chunk of tokens, on top of what is saved and the incoming gradient: the final norm after the
    # loss, or a block's second norm, with the block's attention still saved
    norm_tmp = e * n_n * h + norm_backward_chunk_bytes(h, min(n_n, backward_chunk_rows(h)), e)
    terms["norm_backward_temporaries"] = norm_tmp
    phases["norm_backward"] = max(res_fwd + rope + norm_saved(n_n, False) + e * n_n * h,
                                  res_bwd + rope - (shared if ac else layer)
                                  + tr["norm_bwd_in_layer"]) + norm_tmp
    peak_phase = max(phases, key=phases.get)
    return ActivationEstimate(stored_per_layer=per_layer, stored_outside=outside, stored=stored,
                              phases=phases, peak=phases[peak_phase], peak_phase=peak_phase, terms=terms,
                              host=host)


def norm_backward_chunk_bytes(h: int, rows: int, e: int) -> int:
    """Peak temporaries of one RmsNormFn backward chunk of `rows` tokens: the fp32 normalised
    input and g = dy * w in fp32, plus (bf16) g's bf16 product before its cast."""
    return (8 + (e if e < 4 else 0)) * rows * h


def tsp_selective_saved(cfg: ModelConfig, layout: Layout, seq_len: int, prec: Precision = BF16) -> int:
    """Bytes per layer and rank that parallel.tsp_recompute=selective keeps beyond X_p
    (parallel/tsp/attention.py, `_Item`): per item (owner r, head bucket b) the local q
    [B, T, hq_b, d] and stacked k/v [B, T, 2, hkv_b, d] after RoPE, the attention output a and the
    kernel's saved output per zigzag run ([B, T, hq_b d] each, activation dtype) and its fp32
    log-sum-exp [B, hq_b heads, T]; the kernel's views of the gathered K/V are dropped. Summed
    over the D n_b items that is every head of the model for this rank's T = B S / D tokens:
    e T (3 n_h d + 2 h_kv) + 4 T n_h (the same for the CPU log-sum-exp route and CUDA's flash
    kernel: both save their output and log-sum-exp). The same under tsp_recompute=none (whose
    attention keeps what selective keeps). 0 under full recompute."""
    if not layout.keeps_attention:
        return 0
    n = layout.micro_batch * seq_len // layout.degree
    nh, d = cfg.num_heads, cfg.head_dim
    return prec.act * n * (3 * nh * d + 2 * cfg.kv_hidden_size) + 4 * n * nh


def tsp_mlp_kept(cfg: ModelConfig, layout: Layout, seq_len: int, prec: Precision = BF16) -> int:
    """Bytes per layer and rank that parallel.tsp_recompute=none keeps beyond selective
    (parallel/tsp/mlp.py): per ring step j (weight shard j of D) the gate and up pre-activations
    g = X_p W_gate_j^T (+b) and u = X_p W_up_j^T (+b), each [B T, I/D] in the activation dtype,
    alive from the layer's forward until its MLP backward. Over the D shards: 2 e T I with
    T = B S / D. 0 under full and selective recompute (their backward re-runs gate/up)."""
    if not layout.keeps_mlp:
        return 0
    n = layout.micro_batch * seq_len // layout.degree
    return 2 * prec.act * n * cfg.intermediate_size


def _mask_terms(seq_len: int, s_p: int, e: int, device: str) -> dict[str, int]:
    """Causal masks of `attention_core` for the zigzag runs (C = S / (2 S_p) queries each): none on
    either device. CUDA passes a lower-right CausalBias to a fused kernel; CPU splits each run into
    its key prefix (no mask) and its diagonal block (`is_causal`) and merges them by log-sum-exp
    (model/attention_lse.py), whose [B, H, C, d] partial outputs are no larger than the `outs`
    term the callers count. (The former CPU route, a bool mask per block of queries, is
    SdpaRoute("cpu_blocked_mask"); the planner no longer models it.)"""
    return {"c": seq_len // (2 * s_p), "mask": 0, "bias": 0, "biases": 0}


def _kv_expansion(e: int, device: str, gqa: bool) -> bool:
    """Whether `attention_core` repeats K/V heads to the query heads before SDPA: on CUDA when
    the route is the memory-efficient kernel under GQA (fp32; model/attention_route.py)."""
    if device != "cuda" or not gqa:
        return False
    import torch

    from tsp_trainer.model.attention_route import sdpa_route

    dtype = torch.float32 if e == 4 else torch.bfloat16
    return sdpa_route("cuda", dtype, gqa=True, head_dim=128).expand_kv


def _zigzag_attention(e: int, b: int, seq_len: int, s_p: int, hq: int, hkv: int, n: int, *,
                      recomputed_qkv: bool, scatter_copies: int, device: str) -> dict[str, int]:
    """Transient bytes of one zigzag attention call (all-gathered K/V, `attention_core` per run) for
    hq query and hkv key/value channels per call and n local tokens: forward, backward with
    recompute, and the dK/dV reduce-scatter (`scatter_copies` K/V-sized buffers alive then: dK/dV,
    their stack, the reordered copy, and for TSP the re-gathered K/V still referenced)."""
    m = _mask_terms(seq_len, s_p, e, device)
    kv_full = 2 * e * b * seq_len * hkv                   # gathered K and V in logical order
    # CUDA memory-efficient route under GQA: K/V repeated to the query heads (saved by SDPA for
    # its backward, and their gradients before they are summed back to the K/V heads)
    kv_exp = kv_full * hq // hkv if _kv_expansion(e, device, hq != hkv) else 0
    outs = 2 * e * b * m["c"] * hq                        # SDPA outputs of the two runs
    qkv = e * n * (hq + 2 * hkv) if recomputed_qkv else 0
    # with B > 1 the zigzag reorders (zigzag.py) copy once more (a transpose made contiguous)
    extra = 1 if b > 1 else 0
    fwd = qkv + kv_full + kv_exp + max(m["mask"] + m["bias"] + outs, (1 + extra) * kv_full)
    # backward: re-gathered K/V and both additive masks, then either the recompute (bool mask of
    # the long run alive) or SDPA's backward (dK, dV of the whole prefix); then the reduce-scatter
    # of dK/dV (gradients, their stacked copy and the zigzag-reordered copy)
    bwd = qkv + max(kv_full + 2 * kv_exp + m["biases"] + max(m["mask"] + outs, kv_full + e * b * m["c"] * hq),
                    (scatter_copies + extra) * kv_full)
    return {"fwd": fwd, "bwd": bwd, "kv_full": kv_full, **m}


def _tsp_transients(cfg, layout, seq_len, prec, tok, p_attn, norm_saved, device, sel,
                    mlp_kept) -> dict[str, int]:
    """Transients of TSP (parallel/tsp/): the attention's weight pool, K/V buckets and fp32
    gradient buffers (`_tsp_attention_terms`), the MLP ring's shards and accumulators, the vocab
    ring's logits block. `sel`: the layer's kept attention bytes (selective, none; 0 under full),
    alive from the layer's forward until its attention backward; `mlp_kept`: the gate/up
    pre-activations none keeps (0 otherwise), alive from the MLP's forward until its backward."""
    e, ew = prec.act, prec.weight
    d_ = layout.degree
    h, inter, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    n = tok["region"]
    a = _tsp_attention_terms(cfg, layout, seq_len, prec, n, p_attn, device, sel)
    w_mlp = cfg.mlp_sharded_params // d_ * ew
    own = norm_saved(n, True)                           # norm's saved tensors + X_p
    acc32 = 4 * n * h                                   # fp32 output (forward) or dX (backward)
    mid = e * n * inter // d_                           # one [N/D, I/D] MLP intermediate
    # a ring step's intermediates: g, u and silu(g) u (or that product and the step's output);
    # under none g and u are the kept ones (in mlp_kept, every shard's by the last step), silu(g)
    # and the product are the step's own
    step_mids = 2 if layout.keeps_mlp else 3
    mlp_fwd = acc32 + 2 * w_mlp + max(step_mids * mid, mid + e * n * h)
    # backward of a ring step: full and selective re-run g, u (+ silu(g), its product, dh, dg/du);
    # none reads the kept g, u instead of re-running them (5: measured on fake tensors with an
    # MLP-heavy shape, I = 16 h, where the MLP backward is the peak: -2.8 to +3.2%; 4 gave -8.5%)
    bwd_mids = 5 if layout.keeps_mlp else 6
    out = {"attn_fwd": own + a["fwd"], "mlp_fwd": 2 * own + sel + mlp_kept + mlp_fwd,
           "attn_fwd_nograd": e * n * h + a["fwd"], "mlp_fwd_nograd": e * n * h + mlp_fwd,
           # backward: the incoming gradient dy [N/D, h]; the kept items stay until attention's
           "attn_bwd": own + e * n * h + a["bwd"],
           "mlp_bwd": (2 * own + sel + mlp_kept + 2 * e * n * h + acc32
                       + _mlp_ring_backward_shards(w_mlp, ew) + bwd_mids * mid),
           # ring of vocab shards: one fp32 logits block [N/D, V/D] (its exp / softmax computed in
           # place) and, in bf16, the bf16 block it is cast from; x and dX in fp32; in backward
           # (tsp/ring.py::ring_backward) the shard in use and the one arriving, three fp32
           # [V/D, h] gradients (the one being computed, in bf16 also its bf16 product, the
           # accumulator being sent and the one arriving)
           "head": ((4 + (e if e < 4 else 0)) * n * (V // d_) + 8 * n * h
                    + V // d_ * h * (2 * ew + 3 * 4 + (ew if ew < 4 else 0))),
           "norm_bwd_in_layer": own + sel + norm_saved(n, False) + e * n * h,
           "kv_bucket": a["kv_bucket"], "mask": 0, "bias": 0}
    return out


def _tsp_attention_terms(cfg, layout, seq_len, prec, n, p_attn, device, sel) -> dict[str, int]:
    """TSP attention's transient bytes (parallel/tsp/attention.py, issue 12's overlap), per rank,
    for the worst item (the model describes rank 0). Items (r, b) run one step ahead: item i+1's
    projection and K/V all-gather are issued before item i's attention. Counted in units of one
    item (hq_b, hkv_b = this rank's query / K/V channels per bucket, n local tokens):

      qkv   = e n (hq_b + 2 hkv_b)   the item's local q and stacked k/v
      kv    = 2 e B S hkv_b          one gathered K/V bucket (the raw gather or its logical copy)
      q_b   = e n hq_b               a query-sized temporary (output a, dA, dq)

    forward:  fp32 output 4nh, min(3, D) weight buffers, the current and the next item's qkv, three
              K/V buckets (this item's gather and its logical-order copy, the next item's gather in
              flight), two q_b; selective adds the items already kept (the largest phase is the
              item before last, or the last with every item kept and two buckets alive);
    backward: fp32 dX 4nh, min(2, D) weight buffers and min(3, D) fp32 gradient buffers (the one
              filled, the one being reduced, and rank 0's own summed gradient once its turn is
              over), two items' qkv (full recompute projects this and the next item), four K/V
              buckets (re-gathered, the next in flight, dK and dV, their rank-major copy for the
              reduce-scatter), three q_b; selective (and none) projects nothing but holds its kept
              items and one more q_b; at the end, in bf16, dX and the gradients cast to the
              weights' dtype. K/V expanded to the query heads (CUDA, fp32 + GQA) once per phase.
    Coefficients measured on fake tensors per block (tests/unit/test_plan_fake.py checks the
    step within 10%)."""
    e, ew = prec.act, prec.weight
    d_, nb, b = layout.degree, layout.head_buckets, layout.micro_batch
    h = cfg.hidden_size
    hq_b = cfg.num_heads * cfg.head_dim // (d_ * nb)
    hkv_b = cfg.kv_hidden_size // (d_ * nb)
    items = d_ * nb
    qkv, q_b = e * n * (hq_b + 2 * hkv_b), e * n * hq_b
    kv = 2 * e * b * seq_len * hkv_b
    kv_exp = kv * hq_b // hkv_b if _kv_expansion(e, device, hq_b != hkv_b) else 0
    w = p_attn // d_ * ew
    acc32 = 4 * n * h
    w_fwd = min(3, d_) * w
    w_bwd = min(2, d_) * w + min(3, d_) * w * 4 // ew
    cast = (e * n * h + w) if ew != 4 else 0            # dX and the gradients cast from fp32
    fwd = acc32 + w_fwd + 2 * qkv + 3 * kv + 2 * q_b + kv_exp
    if layout.keeps_attention:
        sel_item = sel // items
        fwd = max(fwd + max(items - 2, 0) * sel_item, acc32 + w_fwd + sel + 2 * kv + kv_exp)
        bwd_item = sel + 4 * kv + 4 * q_b + kv_exp
    else:
        bwd_item = 2 * qkv + 4 * kv + 3 * q_b + kv_exp
    bwd = acc32 + w_bwd + max(bwd_item, cast)
    return {"fwd": fwd, "bwd": bwd, "kv_bucket": kv}


def _mlp_ring_backward_shards(w: int, ew: int) -> int:
    """Bytes of packed MLP shards alive in a step of the reverse ring (tsp/mlp.py,
    tsp/ring.py::ring_backward_into): the shard in use and the one arriving (2 w) and two fp32
    accumulators (the one being filled, the one arriving; the sent one is reused as the next
    receive buffer); weight gradients go straight into the accumulator (in bf16 through one
    weight-sized product at a time)."""
    acc = w * 4 // ew
    return 2 * w + 2 * acc + (w // 3 if ew != 4 else 0)


def _baseline_transients(cfg, layout, seq_len, prec, tok, norm_saved, layer_saved, device) -> dict[str, int]:
    """Transients of the baselines (parallel/baselines/): the TP region's partial output and its
    reduced copy, the gradients of q/k/v and the MLP intermediates, the zigzag attention of the sp
    sub-axis (gathered K/V of all local heads, masks), the vocab-parallel logits."""
    e, ew = prec.act, prec.weight
    t, s_p, seqpar = layout.axes
    b = layout.micro_batch
    h, hkv, inter, V, nh = (cfg.hidden_size, cfg.kv_hidden_size, cfg.intermediate_size,
                            cfg.vocab_size, cfg.num_heads)
    n_r, n_n = tok["region"], tok["norm"]
    a_r, a_n = e * n_r * h, e * n_n * h                 # activations of the region / of the norms
    own1 = norm_saved(n_n, not seqpar) + (a_r if seqpar else 0)
    attn_saved = e * n_r * (2 * h + 2 * hkv) // t + (4 * nh // t * n_r if s_p == 1 else 0)
    mid = e * n_r * inter // t
    leave = a_r + (a_n if seqpar else a_r)              # partial output + reduced copy
    dgrad_in = a_n + (a_r if seqpar else 0)             # incoming gradient (+ its gathered copy)
    if s_p > 1:
        z = _zigzag_attention(e, b, seq_len, s_p, h // t, hkv // t, n_r, recomputed_qkv=False,
                              scatter_copies=3, device=device)
        core_fwd, core_bwd = z["fwd"], z["bwd"]
        wgrad = 2 * ew * h * inter // t                 # a weight gradient and its all-reduced clone
    else:
        core_fwd = 0
        core_bwd = e * n_r * (2 * h + 2 * hkv) // t     # d(out), dq, dk, dv
        wgrad = 0
    # backward: autograd frees each node's saved tensors as it runs, so the peak is where a block's
    # saved tensors meet the first gradients (dy, d(intermediate)), or, in attention, the SDPA /
    # zigzag backward; then dX partials of q/k/v summed and all-reduced (or reduce-scattered)
    out = {"attn_fwd": own1 + attn_saved + max(core_fwd, leave),
           "mlp_fwd": layer_saved + leave,
           "attn_fwd_nograd": a_n + (a_r if seqpar else 0) + max(core_fwd, attn_saved + leave),
           "mlp_fwd_nograd": a_n + (a_r if seqpar else 0) + 3 * mid + leave,
           "attn_bwd": own1 + max(attn_saved + dgrad_in + core_bwd, dgrad_in + 3 * a_r),
           "mlp_bwd": layer_saved + dgrad_in + mid + wgrad,
           "norm_bwd_in_layer": own1 + attn_saved + norm_saved(n_n, False) + a_n,
           # bf16 logits while the fp32 copy is made; backward: their gradient in bf16, dX, dW
           # (none in fp32: the cross-entropy works on the logits in place)
           "head": (e * n_r * V // t if e != 4 else 0) + a_r + V // t * h * ew * (2 if s_p > 1 else 1)}
    return out


# ---------------------------------------------------------------------------------------------
# communication


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
        for (op, tag), v in base.items():
            add(f"{op}/{tag}", v["count"], v["bytes"], layout.degree)
        if layout.activation_checkpointing and layout.degree > 1:
            d, nb = layout.degree, layout.head_buckets
            p_attn, p_mlp = cfg.attn_sharded_params, cfg.mlp_sharded_params
            kv_bucket = b * seq_len * 2 * (cfg.kv_hidden_size // (d * nb)) * e
            add("broadcast/attn.weights", L * d, L * d * (p_attn // d) * ew, d)
            add("all_gather/attn.kv", L * d * nb, L * d * nb * kv_bucket, d)
            for op in ("send", "recv"):
                add(f"{op}/mlp.weights", L * (d - 1), L * (d - 1) * (p_mlp // d) * ew, d)
        return out
    for key, nbytes, count, group in _baseline_ledger(cfg, layout, seq_len, prec):
        add(key, count, nbytes, group)
    return out


def _baseline_ledger(cfg, layout, seq_len, prec):
    """(key, bytes, count, group size) of a baseline's forward + backward: the bytes are
    `expected_ledger_bytes`; the counts and the AC replay follow baselines/megatron.py and
    context.py (with early-stopping recompute, a checkpointed block replays its forward only up to
    the last saved tensor: the attention's region exit but not the MLP's)."""
    from tsp_trainer.parallel.baselines.comm_model import expected_ledger_bytes

    t, s_p, seqpar = layout.axes
    e, L, b, h = prec.act, cfg.num_layers, layout.micro_batch, cfg.hidden_size
    kw = {"tp_degree": layout.tp, "sp_degree": layout.sp,
          "tp_sequence_parallel": layout.tp_sequence_parallel} if layout.scheme == "tp_x_sp" else {}
    base = expected_ledger_bytes(cfg, layout.scheme, degree=layout.degree, batch=b, seq_len=seq_len,
                                 dtype_bytes=e, **kw)
    n_r = b * seq_len // s_p
    a = n_r * h * e
    kv = b * seq_len * 2 * (cfg.kv_hidden_size // t) * e
    per_op_counts = {
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
    }
    rows = []
    for key, nbytes in base.items():
        group = s_p if key.endswith((".kv", ".dkv", "wgrad", "loss.count")) else t
        if key in ("all_reduce/norm.grad", "all_reduce/bias.grad"):
            group = layout.degree if (seqpar and s_p > 1) else (s_p if s_p > 1 else t)
        rows.append((key, nbytes, per_op_counts[key], group))
    if layout.activation_checkpointing:
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


# bytes a rank receives per op, as a fraction of the ledger payload, for ring / pipelined
# algorithms on g ranks (rooted ops averaged over the ranks; P2P: the received tensor).
WIRE_FACTOR = {"all_reduce": lambda g: 2 * (g - 1) / g, "all_gather": lambda g: (g - 1) / g,
               "reduce_scatter": lambda g: (g - 1) / g, "broadcast": lambda g: (g - 1) / g,
               "reduce": lambda g: (g - 1) / g, "recv": lambda g: 1.0, "send": lambda g: 0.0}


def wire_bytes(entries: dict[str, dict[str, int]]) -> dict[str, float]:
    """{"op/tag": bytes received per rank} of ledger-style entries."""
    return {k: v["bytes"] * WIRE_FACTOR[k.split("/")[0]](v["group"]) for k, v in entries.items()
            if v["group"] > 1}


# ---------------------------------------------------------------------------------------------
# compute and time


def hardware_flops_per_token(cfg: ModelConfig, layout: Layout, seq_len: int) -> dict[str, float]:
    """Model FLOPs (observability/flops.py: causal attention halved, backward = 2 x forward) and the
    FLOPs the code really executes, + what its backward recomputes. TSP with full recompute saves
    only X_p: its attention backward re-runs the q/k/v projections and the attention forward
    (not W_o: dW_o and dA need only A and dy) and its MLP backward the gate and up projections (not
    W_down); with tsp_recompute=selective the attention part is kept, only gate/up are re-run;
    with tsp_recompute=none gate/up are kept too and backward re-runs no forward GEMM. SP-style context attention recomputes the attention core; activation checkpointing replays
    each block once more (every matmul)."""
    model = flops_per_token(cfg, seq_len)
    block_fwd = 2 * block_matmul_params(cfg) + attention_flops_per_token(cfg, seq_len)
    core_fwd = attention_flops_per_token(cfg, seq_len)
    _, s_p, _ = layout.axes
    extra = 0.0
    if layout.scheme == "tsp":
        L, h = cfg.num_layers, cfg.hidden_size
        qkv_proj = 2 * L * h * (cfg.num_heads * cfg.head_dim + 2 * cfg.kv_hidden_size)
        gate_up = 2 * L * 2 * h * cfg.intermediate_size
        extra += (0 if layout.keeps_mlp else gate_up) + (0 if layout.keeps_attention else qkv_proj + core_fwd)
    elif s_p > 1:
        extra += core_fwd
    if layout.activation_checkpointing:
        extra += block_fwd
    return {"model": model, "hardware": model + extra}


@dataclass
class Prediction:
    layout: Layout
    memory: dict[str, int]              # params, grads, optimizer, activations_peak, total
    fits: bool
    capacity: float
    activation: ActivationEstimate
    comm_mp: dict
    comm_dp: dict
    times: dict[str, float]             # seconds: compute, exposed comm, ... per optimizer step
    step_time: float
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    hfu: float

    def as_dict(self) -> dict:
        a = self.activation
        return {"layout": self.layout.as_dict(), "label": self.layout.label(), "memory": self.memory,
                "fits": self.fits, "capacity_bytes": self.capacity,
                "activation": {"stored_per_layer": a.stored_per_layer, "stored_outside": a.stored_outside,
                               "stored": a.stored, "phases": a.phases, "peak": a.peak,
                               "peak_phase": a.peak_phase, "terms": a.terms},
                "comm_mp_per_micro_step": self.comm_mp, "comm_dp_per_step": self.comm_dp,
                "times_s": self.times, "step_time_s": self.step_time, "tokens_per_s": self.tokens_per_s,
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "mfu": self.mfu, "hfu": self.hfu}


def _link_bw(group_span: int, hw: HardwareProfile, *, p2p: bool) -> float:
    """Bandwidth of a group of `group_span` consecutive ranks: inside one node -> the node fabric
    (one peer for P2P rings), across nodes -> the NIC."""
    if group_span <= hw.gpus_per_node:
        return hw.p2p_bw if p2p else hw.intra_node_bw
    return hw.inter_node_bw


# Overlap model (docs/planner.md section 4): which ledger tags the code issues asynchronously and
# waits for later (they can hide behind compute), and which it issues synchronously (exposed).
# TSP's K/V all-gathers and dK/dV reduce-scatters are issued one item ahead (issue 12): all but
# one item per layer and pass hide behind compute (see `predict`).
OVERLAPPABLE_TAGS = ("attn.weights", "attn.wgrad", "mlp.weights", "mlp.weights.grad", "embed.weights",
                     "embed.weights.grad", "head.weights", "head.weights.grad")


def predict(cfg: ModelConfig, layout: Layout, seq_len: int, hw: HardwareProfile, *,
            global_batch: int | None = None, prec: Precision = BF16,
            assumptions: Assumptions = Assumptions()) -> Prediction:
    """Memory, communication and time of one optimizer step of `layout` on `hw`."""
    st = state_bytes(cfg, layout, prec)
    act = activation_memory(cfg, layout, seq_len, prec, device="cuda")
    total = st["params"] + st["grads"] + st["optimizer"] + act.peak
    capacity = hw.hbm_bytes * assumptions.hbm_usable
    memory = {"params": st["params"], "grads": st["grads"], "optimizer": st["optimizer"],
              "activations_stored": act.stored, "activations_peak": act.peak, "total": total,
              "host_offloaded": act.host}

    mp = model_parallel_comm(cfg, layout, seq_len, prec)
    dp = data_parallel_comm(cfg, layout, prec)
    eff_c, eff_n = assumptions.compute_efficiency, assumptions.comm_efficiency
    flops = hardware_flops_per_token(cfg, layout, seq_len)
    tokens_micro = layout.micro_batch * seq_len                    # per replica
    t_compute = flops["hardware"] * tokens_micro / layout.degree / (hw.peak_flops * eff_c)

    overlappable = exposed = 0.0
    for key, v in mp.items():
        op, tag = key.split("/", 1)
        g = v["group"]
        if g <= 1:
            continue
        span = g if tag not in ("attn.kv", "attn.dkv", "wgrad", "loss.count") or layout.scheme == "tsp" \
            else layout.degree                                     # the sp sub-axis strides over tp
        bw = _link_bw(span, hw, p2p=op in ("send", "recv")) * eff_n
        seconds = v["bytes"] * WIRE_FACTOR[op](g) / bw + v["count"] * assumptions.op_latency_s
        if layout.scheme == "tsp" and tag in OVERLAPPABLE_TAGS:
            overlappable += seconds
        elif layout.scheme == "tsp" and tag in ("attn.kv", "attn.dkv"):
            # issued one item ahead (parallel/tsp/attention.py): only each pass's first item of a
            # layer waits for its K/V (forward, backward; the AC replay) and the last item's dK/dV
            # reduce-scatter is waited for before the layer's backward ends
            first = 1 / (layout.degree * layout.head_buckets)
            exposed += seconds * first
            overlappable += seconds * (1 - first)
        else:
            exposed += seconds
    # activation offload: every block's saved tensors go to the host in forward and come back in
    # backward on a side stream, overlapped with compute (model/offload.py)
    t_offload = 2 * act.host / (hw.host_bw * eff_n)
    t_micro = max(t_compute, overlappable, t_offload) + exposed
    # DP: gradients reduced while the last micro-step's backward runs (2/3 of its compute);
    # ZeRO-1/2 all-gather the updated parameters after the step (exposed)
    t_dp_grad = t_dp_params = 0.0
    for key, v in dp.items():
        op = key.split("/")[0]
        bw = _link_bw(layout.world, hw, p2p=False) * eff_n
        seconds = v["bytes"] * WIRE_FACTOR[op](v["group"]) / bw
        if key.endswith("dp.params"):
            t_dp_params += seconds
        else:
            t_dp_grad += seconds
    t_dp_exposed = max(0.0, t_dp_grad - 2 / 3 * t_compute) + t_dp_params
    # AdamW reads and writes fp32 master + 2 moments, reads the gradient, writes the bf16 weight
    shard = st["param_count"] / (layout.dp if layout.zero_stage >= 1 else 1)
    t_opt = shard * (2 * prec.optimizer + (prec.grad_accum or prec.grad) + prec.weight) / hw.hbm_bw
    step = layout.grad_accum * t_micro + t_dp_exposed + t_opt
    batch = global_batch if global_batch is not None else layout.micro_batch * layout.grad_accum * layout.dp
    tps = batch * seq_len / step
    per_gpu = tps / layout.world
    times = {"compute_per_micro": t_compute, "overlappable_comm_per_micro": overlappable,
             "exposed_comm_per_micro": exposed, "offload_per_micro": t_offload, "micro_step": t_micro, "dp_grad_comm": t_dp_grad,
             "dp_param_allgather": t_dp_params, "dp_exposed": t_dp_exposed, "optimizer": t_opt}
    return Prediction(layout=layout, memory=memory, fits=total <= capacity, capacity=capacity,
                      activation=act, comm_mp=mp, comm_dp=dp, times=times, step_time=step,
                      tokens_per_s=tps, tokens_per_s_per_gpu=per_gpu,
                      mfu=flops["model"] * per_gpu / hw.peak_flops,
                      hfu=flops["hardware"] * per_gpu / hw.peak_flops)


__all__ = ["Assumptions", "BF16", "FP32", "Layout", "Precision", "Prediction", "activation_memory",
           "data_parallel_comm", "hardware_flops_per_token", "model_parallel_comm", "param_count",
           "predict", "state_bytes", "wire_bytes"]
