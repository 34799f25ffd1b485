"""Transient bytes of one training step per rank: what a layer's forward and backward, the loss
and RMSNorm's backward allocate on top of the saved activations, per scheme. `activations.py` adds
them to what the layers saved to find the peak of each phase.

Notation as in docs/planner.md: e bytes per activation element, n this rank's tokens, h hidden,
h_kv = n_kv * d, I intermediate, V vocab, D the model-parallel degree, n_b head buckets (TSP),
c the tokens of one loss chunk (parallel.loss_chunk_tokens; c = n when the loss is not tiled),
m the tokens of one MLP chunk (parallel.mlp_chunk_tokens; m = n when the MLP is not tiled),
k the local tokens of one K/V chunk of TSP attention (parallel.attention_chunk_tokens; k = S / D
when unchunked).
"""

from __future__ import annotations

from tsp_trainer.config import ModelConfig
from tsp_trainer.config.model import padded_vocab_size
from tsp_trainer.model.rms_norm import chunk_rows
from tsp_trainer.plan.layout import Layout
from tsp_trainer.plan.precision import Precision


def rms_norm_saved(tokens: int, h: int, e: int, *, output_kept: bool) -> int:
    """Bytes RmsNormFn (model/rms_norm.py) saves for `tokens` tokens: its input x (activation
    dtype) and rstd [tokens, 1] in fp32; plus the output when the consumer saves it."""
    return (e + (e if output_kept else 0)) * tokens * h + 4 * tokens


def tsp_norms_handed_over(layout: Layout, n: int, mlp_chunk: int | None) -> bool:
    """Whether a TSP block's norms hand their work to the attention and the MLP
    (parallel/tsp/norm.py): when the layer's tokens are tiled (m < n). The consumers then keep the
    norms' inputs and rstd (no [n, h] output) and remake each output per token chunk."""
    return (layout.scheme == "tsp" and mlp_chunk is not None and mlp_chunk < n
            and layout.tiled_accumulators and layout.norm_handoff)


def tsp_norm_chunk(h: int, m: int, e: int) -> int:
    """Bytes of one norm output a consumer remakes (tsp/norm.py NormedRows): the [m, h] rows in the
    activation dtype and the two fp32 [chunk_rows, h] temporaries of rms_norm_apply."""
    return e * m * h + 8 * min(m, chunk_rows(h)) * h


def expands_kv(e: int, device: str, gqa: bool) -> bool:
    """Whether `attention_core` repeats K/V heads to the query heads before SDPA: on CUDA when
    the route is the memory-efficient kernel under GQA (fp32; model/attention_route.py)."""
    if device != "cuda" or not gqa:
        return False
    import torch

    from tsp_trainer.model.attention_route import sdpa_route

    dtype = torch.float32 if e == 4 else torch.bfloat16
    return sdpa_route("cuda", dtype, gqa=True, head_dim=128).expand_kv


def native_gqa(e: int, device: str, gqa: bool, head_dim: int, path: str = "native") -> bool:
    """Whether `attention_core` runs the GQA-native path (model/attention_gqa.py) under
    train.attention_gqa=`path` (Layout.attention_gqa): on CUDA under GQA on the flash route
    (bf16 / fp16, head_dim a multiple of 8) with path native. With `path` fused the same route runs
    SDPA's fused GQA call, whose expanded dK/dV plan/reserved.py counts."""
    if device != "cuda" or not gqa:
        return False
    import torch

    from tsp_trainer.model.attention_route import sdpa_route

    dtype = torch.float32 if e == 4 else torch.bfloat16
    return sdpa_route("cuda", dtype, gqa=True, head_dim=head_dim, gqa_path=path).gqa_native


def native_gqa_terms(e: int, n_q: int, hq: int, head_dim: int, kv: int) -> dict[str, int]:
    """Bytes the GQA-native path (model/attention_gqa.py) holds beyond a fused call's for n_q
    queries of hq channels (hq / head_dim heads) against keys whose K/V take kv bytes, over the
    zigzag runs' blocks (each run a full block against its prefix and a causal diagonal):
    forward the fp32 merged output and log-sum-exp [n_q, hq] and [n_q, hq / d] (MergedAttention),
    backward the fp32 dQ [n_q, hq] and the dK/dV buffers [n_k, h_kv] of the keys' dtype beside
    a block's own dK/dV (the fused call's output, counted by the caller). Nothing [n_k, hq]."""
    merged = 4 * n_q * hq + 4 * n_q * hq // head_dim
    return {"fwd": merged + e * n_q * hq, "bwd": 4 * n_q * hq + kv}


def _zigzag_attention(e: int, b: int, seq_len: int, s_p: int, hq: int, hkv: int, n: int, *,
                      recomputed_qkv: bool, scatter_copies: int, device: str,
                      head_dim: int, gqa_path: str = "native") -> dict[str, int]:
    """Transient bytes of one zigzag attention call (all-gathered K/V, `attention_core` per run) for
    hq query and hkv key/value channels per call and n local tokens: forward, backward with
    recompute, and the dK/dV reduce-scatter (`scatter_copies` K/V-sized buffers alive then: dK/dV,
    their stack, the reordered copy, and for TSP the re-gathered K/V still referenced).

    No causal mask exists on either device: CUDA passes a lower-right CausalBias to a fused
    kernel; CPU splits each run (C = S / (2 S_p) queries) into its key prefix (no mask) and its
    diagonal block (`is_causal`) and merges them by log-sum-exp (model/attention_lse.py), whose
    [B, H, C, d] partial outputs are no larger than the runs' outputs counted here."""
    c = seq_len // (2 * s_p)                              # queries per zigzag run
    kv_full = 2 * e * b * seq_len * hkv                   # gathered K and V in logical order
    # CUDA memory-efficient route under GQA: K/V repeated to the query heads (saved by SDPA for
    # its backward, and their gradients before they are summed back to the K/V heads)
    kv_exp = kv_full * hq // hkv if expands_kv(e, device, hq != hkv) else 0
    # CUDA flash route under GQA: the per-group-member calls (their merge buffers, dQ, dK/dV sums)
    grouped = (native_gqa_terms(e, b * 2 * c, hq, head_dim, kv_full)
               if native_gqa(e, device, hq != hkv, head_dim, gqa_path) else {"fwd": 0, "bwd": 0})
    outs = 2 * e * b * c * hq + grouped["fwd"]            # SDPA outputs of the two runs
    qkv = e * n * (hq + 2 * hkv) if recomputed_qkv else 0
    # with B > 1 the zigzag reorders (zigzag.py) copy once more (a transpose made contiguous)
    extra = 1 if b > 1 else 0
    fwd = qkv + kv_full + kv_exp + max(outs, (1 + extra) * kv_full)
    # backward: re-gathered K/V (and, expanded, their copy and its gradient), then either the
    # recomputed runs' outputs or SDPA's backward (dK, dV of the whole prefix and one run's dq);
    # then the reduce-scatter of dK/dV (gradients, their stacked copy and the zigzag-reordered copy)
    bwd = qkv + max(kv_full + 2 * kv_exp + max(outs, kv_full + e * b * c * hq + grouped["bwd"]),
                    (scatter_copies + extra) * kv_full)
    return {"fwd": fwd, "bwd": bwd}


def tsp_transients(cfg: ModelConfig, layout: Layout, seq_len: int, prec: Precision, n: int,
                   device: str, sel: int, mlp_kept: int, loss_chunk: int | None = None,
                   mlp_chunk: int | None = None, attention_chunk: int | None = None) -> dict[str, int]:
    """Transients of TSP (parallel/tsp/): the attention's weight pool, K/V buckets and fp32
    gradient buffers (`_tsp_attention_terms`), the MLP ring's shards and accumulators, the vocab
    ring's logits block. `sel`: the layer's kept attention bytes (selective, none, and under AC
    every mode's replay; 0 otherwise), alive from the layer's forward (replay) until its attention
    backward; `mlp_kept`: the gate/up pre-activations none (or the AC replay) keeps (0 otherwise),
    alive from the MLP's forward until its backward.
    n: this rank's tokens, B S / D; loss_chunk: the loss's tokens per chunk (None: n); mlp_chunk:
    the MLP's (None: n; fewer than n also keeps the layer's accumulators in the activation dtype,
    parallel/gated_mlp.py); attention_chunk: local tokens of one K/V chunk (None or >= S / D:
    unchunked)."""
    e, ew = prec.act, prec.weight
    d_ = layout.degree
    h, inter, V = cfg.hidden_size, cfg.intermediate_size, padded_vocab_size(cfg.vocab_size, d_)
    m = n if mlp_chunk is None else min(mlp_chunk, n)
    # accumulators in the activation dtype once tiled (Layout.tiled_accumulators=False: the
    # planner's ablation keeps them fp32)
    tiled = m < n and layout.tiled_accumulators
    a = _tsp_attention_terms(cfg, layout, seq_len, prec, n, device, sel, tiled, attention_chunk)
    c = n if loss_chunk is None else min(loss_chunk, n)
    w_mlp = cfg.mlp_sharded_params // d_ * ew
    # a norm's saved tensors: its input and rstd, and its output X_p, which the consumer keeps
    # unless the norm handed its work over (tiled: the output is remade per token chunk, one
    # chunk's rows alive where they are read, `norm_rows`)
    handed = tsp_norms_handed_over(layout, n, mlp_chunk)
    own = rms_norm_saved(n, h, e, output_kept=not handed)
    # the MLP remakes its chunks of m tokens, the attention chunks of at most the norm's own rows
    norm_rows = tsp_norm_chunk(h, m, e) if handed else 0
    attn_norm_rows = tsp_norm_chunk(h, min(m, chunk_rows(h)), e) if handed else 0
    acc = (e if tiled else 4) * n * h                   # output (forward) or dX (backward)
    cast = 0 if tiled else e * n * h                    # dX cast from fp32 at the end
    mid = e * m * inter // d_                           # one [m, I/D] MLP intermediate
    # a ring step's intermediates: g, u and silu(g) u (or that product and the step's output);
    # under none g and u are the kept ones (in mlp_kept, every shard's by the last step), silu(g)
    # and the product are the step's own
    step_mids = 2 if mlp_kept else 3
    mlp_fwd = acc + 2 * w_mlp + max(step_mids * mid, mid + e * m * h) + norm_rows
    # dX += [dg | du] [W_gate; W_up] accumulates inside its GEMM (addmm_ into a tiled layer's
    # accumulator of the activation dtype, the fp32 output of CUDA's GEMM untiled): no [m, h]
    # product; CPU's bf16 GEMM into fp32 writes one, the size of the final cast, counted apart
    dx_product = 0
    out = {"attn_fwd": own + a["fwd"] + attn_norm_rows, "mlp_fwd": 2 * own + sel + mlp_kept + mlp_fwd,
           # a checkpointed block's first forward makes a handed-over norm's output at once, as the
           # norm would (its saved tensors are dropped): no remade chunk
           "attn_fwd_nograd": e * n * h + a["fwd"], "mlp_fwd_nograd": e * n * h + mlp_fwd - norm_rows,
           # backward: the incoming gradient dy [N/D, h]; the kept items stay until attention's
           "attn_bwd": own + e * n * h + a["bwd"] + attn_norm_rows,
           "mlp_bwd": (2 * own + sel + mlp_kept + e * n * h + cast + acc
                       + _mlp_ring_backward_shards(w_mlp, ew, mlp_kept, d_)
                       + _mlp_chunk_backward(mid, dx_product, kept=bool(mlp_kept)) + norm_rows),
           # ring of vocab shards: one fp32 logits block [c, V/D] (its exp / softmax computed in
           # place) and, in bf16, the bf16 block it is cast from; dX and what is added into it
           # (`_head_dx`); in backward (tsp/ring.py::ring_backward) the shard in use and the one
           # arriving, three fp32 [V/D, h] gradients (the one being computed, the accumulator
           # being sent and the one arriving) and, in bf16 or when tiled, a chunk's product added
           # into the first
           "head": ((4 + (e if e < 4 else 0)) * c * (V // d_) + _head_dx(n, c, h, e)
                    + V // d_ * h * (2 * ew + 3 * 4 + (ew if ew < 4 or c < n else 0))),
           "norm_bwd_in_layer": own + sel + rms_norm_saved(n, h, e, output_kept=False) + e * n * h,
           # no causal mask or bias tensor on either attention route: 0 in the reported terms
           "kv_bucket": a["kv_bucket"], "mask": 0, "bias": 0}
    return out


def _head_dx(n: int, c: int, h: int, e: int) -> int:
    """Bytes of the vocab ring's dX [n, h] (tsp/vocab.py::dx_accumulator_dtype) with what is added
    into it, for n local tokens in loss chunks of c. Untiled: dX in fp32 and one more [n, h],
    counted as 8 n h (fp32: the product; bf16 holds 6 n h, its product and final cast being bf16).
    Tiled: dX in the activation dtype; in bf16 each chunk's GEMM adds into it (no product
    tensor), in fp32 one [c, h] product at a time."""
    if c >= n:
        return 8 * n * h
    return e * n * h + (4 * c * h if e == 4 else 0)


def _tsp_attention_terms(cfg: ModelConfig, layout: Layout, seq_len: int, prec: Precision, n: int,
                         device: str, sel: int, tiled: bool = False,
                         chunk: int | None = None) -> dict[str, int]:
    """TSP attention's transient bytes (parallel/tsp/attention.py), per rank, for the worst item
    (the model describes rank 0). Items (r, b) run one step ahead: item i+1's projection and K/V
    all-gather are issued before item i's attention. Counted in units of one item (hq_b, hkv_b =
    this rank's query / K/V channels per bucket, n local tokens):

      qkv   = e n (hq_b + 2 hkv_b)   the item's local q and stacked k/v
      kv    = 2 e B S hkv_b          one gathered K/V bucket (the raw gather or its logical copy)
      q_b   = e n hq_b               a query-sized temporary (output a, dA, dq)

    K/V heads fewer than D: hkv_b is one head (a copy); the owners sharing it reuse one gather,
    and backward holds their summed dK/dV until the group's last owner in place of the
    reduce-scatter buffers the others skip: the same bucket counts (the fake-tensor check agrees).

    forward:  fp32 output 4nh (e n h once the layer is tiled), min(3, D) weight buffers, the current and the next item's qkv, three
              K/V buckets (this item's gather and its logical-order copy, the next item's gather in
              flight), two q_b; selective adds the items already kept (the largest phase is the
              item before last, or the last with every item kept and two buckets alive);
    backward: fp32 dX 4nh (e n h once tiled), min(2, D) weight buffers and min(3, D) fp32 gradient buffers (the one
              filled, the one being reduced, and rank 0's own summed gradient once its turn is
              over), two items' qkv (full recompute projects this and the next item), four K/V
              buckets (re-gathered, the next in flight, dK and dV, their rank-major copy for the
              reduce-scatter), three q_b; selective (and none) projects nothing but holds its kept
              items and one more q_b; at the end, in bf16, dX and the gradients cast to the
              weights' dtype. K/V expanded to the query heads (CUDA, fp32 + GQA) once per phase;
              under GQA on CUDA's flash route the GQA-native path's buffers (`native_gqa_terms`).
    Coefficients measured on fake tensors per block (tests/unit/test_plan_fake.py checks the
    step within 10%)."""
    e, ew = prec.act, prec.weight
    d_, nb, b = layout.degree, layout.head_buckets, layout.micro_batch
    h = cfg.hidden_size
    hq_b = cfg.num_heads * cfg.head_dim // (d_ * nb)
    hkv_b = cfg.kv_shard_hidden(d_) // nb         # one K/V head (a copy) when they are fewer than D
    items = d_ * nb
    qkv, q_b = e * n * (hq_b + 2 * hkv_b), e * n * hq_b
    kv = 2 * e * b * seq_len * hkv_b
    kv_exp = kv * hq_b // hkv_b if expands_kv(e, device, hq_b != hkv_b) else 0
    # CUDA flash route under GQA: the per-group-member calls (model/attention_gqa.py)
    grouped = (native_gqa_terms(e, n, hq_b, cfg.head_dim, kv)
               if native_gqa(e, device, hq_b != hkv_b, cfg.head_dim, layout.attention_gqa)
               else {"fwd": 0, "bwd": 0})
    w = cfg.attn_shard_params(d_) * ew
    acc32 = (e if tiled else 4) * n * h                 # output / dX: fp32, or e once tiled
    w_fwd = min(3, d_) * w
    w_bwd = min(2, d_) * w + min(3, d_) * w * 4 // ew
    # dX (not once tiled) and the gradients cast from fp32
    cast = ((0 if tiled else e * n * h) + w) if ew != 4 else 0
    fwd = acc32 + w_fwd + 2 * qkv + 3 * kv + 2 * q_b + kv_exp + grouped["fwd"]
    if sel:                                             # items kept (mode, or the AC replay)
        sel_item = sel // items
        fwd = max(fwd + max(items - 2, 0) * sel_item,
                  acc32 + w_fwd + sel + 2 * kv + kv_exp + grouped["fwd"])
        bwd_item = sel + 4 * kv + 4 * q_b + kv_exp + grouped["bwd"]
    else:
        bwd_item = 2 * qkv + 4 * kv + 3 * q_b + kv_exp + grouped["bwd"]
    if chunk is not None and chunk < seq_len // d_:
        return _chunked_attention_terms(e, b * chunk * d_, hkv_b, n, hq_b, cfg.head_dim, qkv, sel, items,
                                        acc32 + w_fwd, acc32 + w_bwd, cast)
    bwd = acc32 + w_bwd + max(bwd_item, cast)
    return {"fwd": fwd, "bwd": bwd, "kv_bucket": kv}


def _chunked_attention_terms(e: int, keys: int, hkv_b: int, n: int, hq_b: int, d: int, qkv: int, sel: int,
                             items: int, base_fwd: int, base_bwd: int, cast: int) -> dict[str, int]:
    """TSP attention with K/V in chunks (parallel/tsp/chunked.py), per item; `keys` = B D k keys
    of one chunk, kv_c = 2 e keys hkv_b its gathered K/V:

    forward:  three K/V chunks (the one computed, the next in flight, the next item's first),
              the fp32 merged output [n, hq_b] and lse [n, hq_b / d], the output cast at the end
              (q_b) and two query tiles of a kernel call (its stacked queries and output; a call
              takes at most as many queries as the chunk has keys, parallel/tsp/chunked.py);
    backward: the same forward first under full recompute; then the output kept (q_b), fp32 dQ
              (4 n hq_b), three K/V chunks, the chunk's fp32 dK/dV (kv_c 4 / e),
              two rank-major copies for the reduce-scatter (one issued, one in flight), the local
              dK/dV [n, 2 hkv_b] and four query tiles (dout, q, out stacked, dq)."""
    kvc = 2 * e * keys * hkv_b
    q_b = e * n * hq_b
    tile = e * min(n, keys) * hq_b
    merged = 4 * n * hq_b + 4 * n * hq_b // d
    attend = 3 * kvc + merged + q_b + 2 * tile
    fwd = base_fwd + 2 * qkv + attend
    backward_pass = q_b + merged + 3 * kvc + kvc * 4 // e + 2 * kvc + 2 * e * n * hkv_b + 4 * tile
    if sel:
        sel_item = sel // items
        fwd = max(fwd + max(items - 2, 0) * sel_item, base_fwd + sel + attend)
        bwd_item = sel + backward_pass
    else:
        bwd_item = 2 * qkv + max(attend, backward_pass)
    return {"fwd": fwd, "bwd": base_bwd + max(bwd_item, cast), "kv_bucket": kvc}


def _mlp_chunk_backward(mid: int, dx_product: int, *, kept: bool) -> int:
    """Peak bytes of one token chunk of a ring step's backward (parallel/gated_mlp.py,
    `_chunk_backward_into`), in [m, I/D] intermediates of `mid` bytes each. Full and selective
    re-run gate|up ([m, 2 I/D], 2 of them); none (and the AC replay keeping all) reads the kept
    ones, counted in mlp_kept. Two moments compete: the elementwise part, where sigmoid(g),
    silu(g), the [dg | du] buffer (2) and silu''s derivative's temporaries (2) are alive: 6 with
    gate|up kept, 8 re-running it (measured to the byte on real tensors); and the last line, where
    sigmoid(g), silu(g) and [dg | du] (and the re-run gate|up) meet a [m, h] product added into dX
    (`dx_product`; 0 where the GEMM accumulates in place)."""
    elementwise = (6 if kept else 8) * mid
    last_line = (4 if kept else 6) * mid + dx_product
    return max(elementwise, last_line)


def _mlp_ring_backward_shards(w: int, ew: int, kept: int = 0, degree: int = 1) -> int:
    """Bytes of packed MLP shards alive in a step of the reverse ring (tsp/mlp.py,
    tsp/ring.py::ring_backward_into): the shard in use and the one arriving (2 w) and two fp32
    accumulators (the one being filled, the one arriving; the sent one is reused as the next
    receive buffer); weight gradients go straight into the accumulator (in bf16 through one
    weight-sized product at a time). The first step has no accumulator arriving yet: with `kept`
    gate/up bytes (all D steps'), that step holds them all and the next has freed a D-th of them,
    so the second accumulator counts only where it outweighs that D-th."""
    acc = w * 4 // ew
    second = acc if not kept else max(0, acc - kept // max(degree, 1))
    if degree == 1:
        second = 0
    return 2 * w + acc + second + (w // 3 if ew != 4 else 0)


def baseline_transients(cfg: ModelConfig, layout: Layout, seq_len: int, prec: Precision,
                        tok: dict[str, int], layer_saved: int, device: str,
                        loss_chunk: int | None = None, mlp_chunk: int | None = None) -> dict[str, int]:
    """Transients of the baselines (parallel/baselines/): the TP region's partial output and its
    reduced copy, the gradients of q/k/v and the MLP intermediates, the zigzag attention of the sp
    sub-axis (gathered K/V of all local heads), the vocab-parallel logits. tok: tokens per rank in
    the TP region and at the norms; layer_saved: a layer's saved bytes without AC; loss_chunk:
    the loss's tokens per chunk (None or >= the region's tokens: not tiled); mlp_chunk: the MLP's
    (the same; tiled, its backward recomputes a chunk's gate/up: 6 [chunk, I/T] intermediates,
    dX and three fp32 weight-gradient accumulators, counted from parallel/gated_mlp.py)."""
    e, ew = prec.act, prec.weight
    t, s_p, seqpar = layout.axes
    b = layout.micro_batch
    h, inter, V, nh = (cfg.hidden_size, cfg.intermediate_size,
                            cfg.vocab_size, cfg.num_heads)
    n_r, n_n = tok["region"], tok["norm"]
    a_r, a_n = e * n_r * h, e * n_n * h                 # activations of the region / of the norms
    own1 = rms_norm_saved(n_n, h, e, output_kept=not seqpar) + (a_r if seqpar else 0)
    hq = cfg.q_hidden_size
    hkv_t = cfg.kv_shard_hidden(t)                      # K/V channels per tp rank (a copy if fewer)
    attn_saved = e * n_r * (2 * hq // t + 2 * hkv_t) + (4 * nh // t * n_r if s_p == 1 else 0)
    mid = e * n_r * inter // t
    leave = a_r + (a_n if seqpar else a_r)              # partial output + reduced copy
    dgrad_in = a_n + (a_r if seqpar else 0)             # incoming gradient (+ its gathered copy)
    if s_p > 1:
        z = _zigzag_attention(e, b, seq_len, s_p, hq // t, hkv_t, n_r, recomputed_qkv=False,
                              scatter_copies=3, device=device, head_dim=cfg.head_dim,
                              gqa_path=layout.attention_gqa)
        core_fwd, core_bwd = z["fwd"], z["bwd"]
        wgrad = 2 * ew * h * inter // t                 # a weight gradient and its all-reduced clone
    else:
        core_fwd = 0
        core_bwd = e * n_r * (2 * hq // t + 2 * hkv_t)  # d(out), dq, dk, dv
        if native_gqa(e, device, hq // t != hkv_t, cfg.head_dim, layout.attention_gqa):   # a member's dk, dv beside the sum
            core_bwd += e * n_r * 2 * hkv_t
        wgrad = 0
    # backward: autograd frees each node's saved tensors as it runs, so the peak is where a block's
    # saved tensors meet the first gradients (dy, d(intermediate)), or, in attention, the SDPA /
    # zigzag backward; then dX partials of q/k/v summed and all-reduced (or reduce-scattered)
    if mlp_chunk is not None and mlp_chunk < n_r:
        mid_c = e * mlp_chunk * inter // t                  # one [chunk, I/T] intermediate
        mlp_fwd_nograd = 3 * mid_c
        mlp_bwd_mids = 6 * mid_c + a_r + 3 * 4 * h * inter // t
    else:
        mlp_fwd_nograd, mlp_bwd_mids = 3 * mid, mid
    out = {"attn_fwd": own1 + attn_saved + max(core_fwd, leave),
           "mlp_fwd": layer_saved + leave,
           "attn_fwd_nograd": a_n + (a_r if seqpar else 0) + max(core_fwd, attn_saved + leave),
           "mlp_fwd_nograd": a_n + (a_r if seqpar else 0) + mlp_fwd_nograd + leave,
           "attn_bwd": own1 + max(attn_saved + dgrad_in + core_bwd, dgrad_in + 3 * a_r),
           "mlp_bwd": layer_saved + dgrad_in + mlp_bwd_mids + wgrad,
           "norm_bwd_in_layer": own1 + attn_saved + rms_norm_saved(n_n, h, e, output_kept=False) + a_n,
           "head": _baseline_head(n_r, loss_chunk, padded_vocab_size(V, t) // t, h, e, ew, a_r, s_p)}
    return out


def _baseline_head(n_r: int, loss_chunk: int | None, rows: int, h: int, e: int, ew: int, a_r: int,
                   s_p: int) -> int:
    """The LM head's transient (parallel/baselines/layers.py::ParallelLMHead.loss_sum). Whole: the
    bf16 logits while the fp32 copy is made; backward: their gradient in bf16, dX, dW (none in
    fp32: the cross-entropy works on the logits in place; its fp32 softmax block is saved, counted
    in activations.py); under sp the all-reduced clone of the weight gradient. Tiled (c < n_r):
    one chunk's fp32 logits and, in bf16, the bf16 block it is cast from (or, backward, the
    gradient cast back); dX; the fp32 weight gradient and a chunk's product (its sum over sp comes
    after the products are gone). Measured on fake tensors with a vocabulary-dominated shape
    (tests/unit/test_plan_fake.py)."""
    cast = e if e != 4 else 0
    if loss_chunk is None or loss_chunk >= n_r:
        return cast * n_r * rows + a_r + rows * h * ew * (2 if s_p > 1 else 1)
    return (4 + cast) * loss_chunk * rows + a_r + rows * h * (4 + ew)


__all__ = ["baseline_transients", "expands_kv", "native_gqa", "native_gqa_terms", "rms_norm_saved",
           "tsp_norm_chunk", "tsp_norms_handed_over", "tsp_transients"]
