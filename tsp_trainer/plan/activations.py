"""Activation memory per rank: what one forward keeps for the backward (per layer and outside the
layers), where it lives (GPU, or host under activation offload), and the peak of saved + transient
bytes (transients.py) over the phases of one forward + backward.

Derived from what the code keeps (docs/planner.md section 2): RMSNorm saves its input in fp32, the
normalised input and (when the next op keeps it) its output; TSP attention and MLP save only X_p;
the baselines keep what autograd keeps around F.linear / SDPA / SiLU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tsp_trainer.config import ModelConfig
from tsp_trainer.config.model import padded_vocab_size
from tsp_trainer.model.rms_norm import chunk_rows
from tsp_trainer.parallel.loss_chunks import (resolve_attention_chunk_tokens, resolve_loss_chunk_tokens,
                                              resolve_mlp_chunk_tokens)
from tsp_trainer.plan.layout import Layout
from tsp_trainer.plan.precision import BF16, Precision
from tsp_trainer.plan.transients import (baseline_transients, expands_kv, rms_norm_saved,
                                         tsp_norms_handed_over, tsp_transients)


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
    host_traffic: int = 0          # offload: bytes copied device -> host and back, per micro-step
    host_fetch_exposed: int = 0    # offload without prefetch: bytes fetched back on demand


@dataclass(frozen=True)
class _Saved:
    """Saved bytes of one rank, and where they are during the step."""

    layer: int                     # one layer's saved tensors without AC
    per_layer: int                 # one layer's as run (AC: the checkpointed block input)
    outside: int                   # outside the layers, RoPE tables included
    rope: int                      # the fp32 RoPE tables
    forward: int                   # layers' saved bytes on the GPU at the end of the forward
    backward: int                  # layers' saved bytes on the GPU during the backward
    host: int                      # layers' saved bytes in host memory (activation offload)
    traffic: int = 0               # offload: bytes copied to the host and back per micro-step
    fetched: int = 0               # offload: bytes copied back to the device per micro-step


def activation_memory(cfg: ModelConfig, layout: Layout, seq_len: int, prec: Precision = BF16, *,
                      device: str = "cuda", loss_chunk_tokens: int | str = "auto",
                      mlp_chunk_tokens: int | str = "auto",
                      attention_chunk_tokens: int | str = "auto") -> ActivationEstimate:
    """Saved activations and the peak of saved + transient bytes over one forward + backward.

    The transient peak is the largest of the phases listed in `phases`, for the rank with the
    largest causal prefix (module docstring; docs/planner.md section 2).

    device: "cuda" (what the planner predicts: `attention_core` passes a lower-right CausalBias, no
    mask in memory) or "cpu" (the validation runs: prefix and diagonal merged by log-sum-exp, no
    mask either; the two differ in the K/V expansion of the CUDA memory-efficient kernel).
    loss_chunk_tokens: parallel.loss_chunk_tokens, the loss's token chunks (parallel/loss_chunks.py).
    mlp_chunk_tokens: parallel.mlp_chunk_tokens, the MLP's token chunks (parallel/gated_mlp.py).
    attention_chunk_tokens: parallel.attention_chunk_tokens, TSP's K/V chunks (parallel/tsp/chunked.py).
    """
    e, h = prec.act, cfg.hidden_size
    tok = region_tokens(layout, seq_len)
    sel = tsp_selective_saved(cfg, layout, seq_len, prec)       # 0 unless selective or none
    mlp_kept = tsp_mlp_kept(cfg, layout, seq_len, prec)         # 0 unless none
    _check_kept_attention(cfg, layout, prec, device, sel)
    rope = 2 * tok["rope"] * cfg.head_dim * 4                   # fp32 cos, sin tables
    chunk = loss_chunk(cfg, layout, tok, loss_chunk_tokens)
    m_chunk = mlp_chunk(cfg, layout, tok, prec, mlp_chunk_tokens)
    a_chunk = attention_chunk(cfg, layout, seq_len, prec, attention_chunk_tokens, device)
    replay_attn, replay_mlp = tsp_replay_kept(cfg, layout, seq_len, prec, device)   # 0 without AC
    if layout.scheme == "tsp":
        layer, outside = _tsp_saved(cfg, prec, tok, sel, mlp_kept,
                                    tsp_norms_handed_over(layout, tok["region"], m_chunk))
        # the block in backward holds what its mode keeps, or under AC what its replay kept
        tr = tsp_transients(cfg, layout, seq_len, prec, tok["region"], device,
                            sel + replay_attn, mlp_kept + replay_mlp, chunk, m_chunk, a_chunk)
    else:
        layer, outside = _baseline_saved(cfg, layout, prec, tok, chunk, m_chunk)
        tr = baseline_transients(cfg, layout, seq_len, prec, tok, layer, device, chunk, m_chunk)
    ac_input = _ac_block_input(layout, prec, h, tok)
    saved = _place(layout, cfg.num_layers, layer, ac_input if layout.activation_checkpointing else layer,
                   outside + rope, rope)
    norm_tmp = e * tok["norm"] * h + norm_backward_chunk_bytes(h, min(tok["norm"], chunk_rows(h)), e)
    phases = _phases(layout, cfg.num_layers, e * tok["norm"] * h, saved, tr)
    if layout.activation_checkpointing and min(layout.checkpoint_segment_blocks, cfg.num_layers) > 1:
        phases["segment_rerun"] = _segment_rerun_phase(layout, e * tok["norm"] * h, saved, tr)
    phases["norm_backward"] = _norm_backward_phase(layout, prec, h, tok["norm"], saved, tr, norm_tmp)
    peak_phase = max(phases, key=phases.get)
    terms = {"rope_tables": rope, "loss_chunk_tokens": chunk, "mlp_chunk_tokens": m_chunk,
             "attention_chunk_tokens": a_chunk,
             "tsp_selective_kept": sel,
             "tsp_mlp_kept": mlp_kept, "tsp_replay_kept": replay_attn + replay_mlp,
             "layer_saved_no_ac": layer, "ac_block_input": ac_input, "host_offloaded": saved.host,
             "host_traffic": saved.traffic, "host_fetch_exposed": 0 if layout.offload_prefetch else saved.fetched,
             "kept_block_inputs": layout.kept_block_inputs(cfg.num_layers) if layout.activation_checkpointing
             else 0,
             **{f"transient_{k}": v for k, v in tr.items()}, "norm_backward_temporaries": norm_tmp}
    return ActivationEstimate(stored_per_layer=saved.per_layer, stored_outside=saved.outside,
                              stored=saved.forward + saved.outside, phases=phases,
                              peak=phases[peak_phase], peak_phase=peak_phase, terms=terms,
                              host=saved.host, host_traffic=saved.traffic,
                              host_fetch_exposed=terms["host_fetch_exposed"])


def loss_chunk(cfg: ModelConfig, layout: Layout, tok: dict[str, int], setting: int | str = "auto") -> int:
    """Tokens per chunk of the LM head's loss on this rank: the region's tokens against the
    vocabulary shard (V/D for TSP, V/T for the baselines), as the heads resolve it."""
    t = layout.degree if layout.scheme == "tsp" else layout.axes[0]
    return resolve_loss_chunk_tokens(setting, tok["region"], padded_vocab_size(cfg.vocab_size, t) // t)


def mlp_chunk(cfg: ModelConfig, layout: Layout, tok: dict[str, int], prec: Precision,
              setting: int | str = "auto") -> int:
    """Tokens per chunk of a layer's MLP on this rank: the region's tokens against the MLP's
    intermediate block (I/D for TSP, I/T for the baselines), as the blocks resolve it."""
    t = layout.degree if layout.scheme == "tsp" else layout.axes[0]
    return resolve_mlp_chunk_tokens(setting, tok["region"], cfg.intermediate_size // t, prec.act)


def attention_chunk(cfg: ModelConfig, layout: Layout, seq_len: int, prec: Precision,
                    setting: int | str = "auto", device: str = "cuda") -> int:
    """Local tokens (of one sequence) per K/V chunk of TSP attention, as the layers resolve it:
    the gathered K/V of one item is B D 2 (h_kv / (D n_b)) e bytes a local token. The local
    tokens S / D themselves: unchunked (the baselines, which do not chunk, and auto in fp32 on
    CUDA, where the chunks' flash kernel does not run)."""
    local = seq_len // layout.degree
    if layout.scheme != "tsp" or (setting == "auto" and device == "cuda" and prec.act == 4):
        return local
    per_token = layout.micro_batch * 2 * cfg.kv_hidden_size // layout.head_buckets * prec.act
    return resolve_attention_chunk_tokens(setting, local, per_token)


def region_tokens(layout: Layout, seq_len: int) -> dict[str, int]:
    """Tokens per rank in each region of a layer."""
    t, s, seqpar = layout.axes
    b = layout.micro_batch
    if layout.scheme == "tsp":
        n = b * seq_len // layout.degree
        return {"region": n, "norm": n, "rope": seq_len // layout.degree}
    region = b * seq_len // s                     # tokens entering the TP matmuls
    return {"region": region, "norm": region // t if seqpar else region, "rope": seq_len // s}


def _check_kept_attention(cfg: ModelConfig, layout: Layout, prec: Precision, device: str,
                          sel: int) -> None:
    """The trainer refuses selective and none recompute where the attention kernel would save
    expanded K/V copies (parallel/tsp/recompute_rules.py)."""
    if sel and expands_kv(prec.act, device, cfg.num_heads != cfg.num_kv_heads):
        raise ValueError(f"tsp_recompute={layout.tsp_recompute!r} on CUDA in fp32 with GQA: the "
                         "memory-efficient kernel saves expanded K/V copies, which the trainer refuses "
                         "(parallel/tsp/recompute_rules.py); use bf16 or tsp_recompute='full'")


def _tsp_saved(cfg: ModelConfig, prec: Precision, tok: dict[str, int], sel: int,
               mlp_kept: int, norms_handed_over: bool = False) -> tuple[int, int]:
    """(one layer without AC, outside the layers before the RoPE tables) saved by TSP: both norms
    with their outputs (X_p; not once the norms hand their work over, transients.py
    tsp_norms_handed_over) and what selective / none keep; the final norm and the loss's fp32
    log-sum-exp, target and loss per token."""
    e, h, n_n = prec.act, cfg.hidden_size, tok["norm"]
    layer = 2 * rms_norm_saved(n_n, h, e, output_kept=not norms_handed_over) + sel + mlp_kept
    outside = rms_norm_saved(n_n, h, e, output_kept=True) + 4 * tok["region"] * 3
    return layer, outside


def _baseline_saved(cfg: ModelConfig, layout: Layout, prec: Precision,
                    tok: dict[str, int], loss_chunk: int, mlp_chunk: int) -> tuple[int, int]:
    """(one layer without AC, outside the layers before the RoPE tables) saved by a baseline: what
    autograd keeps around its norms, F.linear, SDPA and SiLU (the MLP's intermediates only when
    its tokens are not tiled: a tiled MLP saves its input, and its backward recomputes gate/up per
    chunk); the final norm and the cross-entropy's fp32 softmax block (none when the loss is
    tiled: its backward recomputes each chunk's logits)."""
    e = prec.act
    t, s_p, seqpar = layout.axes
    h, inter = cfg.hidden_size, cfg.intermediate_size
    V = padded_vocab_size(cfg.vocab_size, t)                    # rows padded to a multiple of T
    n_r, n_n = tok["region"], tok["norm"]
    layer = 2 * rms_norm_saved(n_n, h, e, output_kept=not seqpar)
    if seqpar:
        layer += 2 * e * n_r * h                                 # gathered norm output (all tokens)
    q_out = 2 * e * n_r * (cfg.q_hidden_size // t)               # q and the attention output
    kv = 2 * e * n_r * cfg.kv_shard_hidden(t)                    # a copy of one head when n_kv < T
    lse = 4 * (cfg.num_heads // t) * n_r if s_p == 1 else 0      # SDPA logsumexp (not recomputed)
    layer += q_out + kv + lse
    if mlp_chunk >= n_r:
        layer += 4 * e * n_r * (inter // t)                      # gate, silu, up, product
    if e != 4:                                                   # apply_rope's cos/sin cast to the
        layer += 2 * tok["rope"] * cfg.head_dim * e              # activation dtype, kept by autograd
    outside = rms_norm_saved(n_n, h, e, output_kept=not seqpar) + (e * n_r * h if seqpar else 0)
    if loss_chunk >= n_r:
        outside += 4 * n_r * (V // t)                            # fp32 softmax block kept by the CE
    outside += 4 * n_r * 4                                       # the CE's fp32 per-token vectors
    outside += 3 * n_r           # per-token loss bookkeeping (3 B/token, measured on fake tensors)
    return layer, outside


def _ac_block_input(layout: Layout, prec: Precision, h: int, tok: dict[str, int]) -> int:
    """What activation checkpointing keeps of one block: its input, plus an fp32 [n_r] per
    checkpointed baseline block (measured on fake tensors)."""
    ac_input = prec.act * tok["norm"] * h
    if layout.scheme != "tsp":
        ac_input += 4 * tok["region"]
    return ac_input


def _place(layout: Layout, num_layers: int, layer: int, per_layer: int, outside: int,
           rope: int) -> _Saved:
    """Where the layers' saved tensors are. On the GPU: all of them, or with offload
    (model/offload.py) one block in forward (its copy to host draining) and in backward the block
    being backpropagated, with train.offload_prefetch also the one fetched ahead; the host holds
    every layer's. Under nested checkpointing (checkpoint_segment_blocks k > 1) only one block
    input per segment is kept (ceil(L / k), on the GPU or the host), and while a segment is
    backpropagated its re-run has regained up to k - 1 inner block inputs: on the GPU, or with
    offload on the host (model/activation_checkpoint.py), each fetched back for its own block."""
    L = num_layers
    kept = layout.kept_block_inputs(L) if layout.activation_checkpointing else L
    k = min(layout.checkpoint_segment_blocks, L) if layout.activation_checkpointing else 1
    if layout.offload_activations:
        on_device = min(L, 2 if layout.offload_prefetch else 1)
        # copies: every block's saved tensors to the host and back; nesting's re-runs send the
        # inner inputs too, and each segment's input comes back twice (re-run and own backward)
        sent = L * per_layer if k > 1 else kept * per_layer
        fetched = sent + (_segments_with_inner(L, k) * per_layer if k > 1 else 0)
        return _Saved(layer, per_layer, outside, rope, forward=min(L, 1) * per_layer,
                      backward=on_device * per_layer, host=_host_block_inputs(L, k) * per_layer,
                      traffic=sent + fetched, fetched=fetched)
    regained = (k - 1) * per_layer
    return _Saved(layer, per_layer, outside, rope, forward=kept * per_layer,
                  backward=kept * per_layer + regained, host=0)


def _segments_with_inner(num_layers: int, k: int) -> int:
    """Segments of k blocks (the last one shorter) that have inner block inputs to regain."""
    return num_layers // k + (1 if num_layers % k > 1 else 0)


def _host_block_inputs(num_layers: int, k: int) -> int:
    """Block inputs on the host at the most under offload: the kept inputs of the segments not yet
    backpropagated plus the regained inner inputs of the one that is (segment i, 0-based, of n_i
    blocks: i + 1 kept, n_i - 1 regained); L under per-block checkpointing."""
    return max(i + min(k, num_layers - i * k) for i in range(-(-num_layers // k)))


def _phases(layout: Layout, num_layers: int, block_input: int, saved: _Saved,
            tr: dict[str, int]) -> dict[str, int]:
    """Live bytes in the forward, backward and loss phases: the transients of the phase on top of
    what the layers saved (`block_input`: one block input's bytes)."""
    ac, s = layout.activation_checkpointing, saved
    # the layers before the last one
    below = s.forward - s.per_layer + (s.per_layer if layout.offload_activations and num_layers > 1 else 0) + s.rope
    phases = {}
    if ac:
        # forward: no saved tensors inside a checkpointed block; backward: the block is recomputed
        # (its saved tensors come back) and then backpropagated
        phases["forward"] = below + max(tr["attn_fwd_nograd"], tr["mlp_fwd_nograd"])
        phases["backward"] = (s.backward + s.rope + max(tr["attn_bwd"], tr["mlp_bwd"])
                              - _shared_block_input(layout, block_input))
    else:
        phases["forward"] = below + max(tr["attn_fwd"], tr["mlp_fwd"])
        phases["backward"] = s.backward + s.rope - s.layer + max(tr["attn_bwd"], tr["mlp_bwd"])
    phases["loss"] = s.forward + s.outside + tr["head"]
    return phases


def _shared_block_input(layout: Layout, block_input: int) -> int:
    """Under AC the recomputed first norm saves the checkpointed block input itself (one tensor):
    TSP's backward peak sees that sharing, the baselines' peak comes while a second block-input
    sized tensor (the incoming gradient's region copy) is alive (measured on fake tensors)."""
    return block_input if (layout.activation_checkpointing and layout.scheme == "tsp") else 0


def _segment_rerun_phase(layout: Layout, block_input: int, saved: _Saved, tr: dict[str, int]) -> int:
    """Nested checkpointing: a segment's re-run in backward, a forward without grad of its blocks
    but the last, on top of the incoming gradient (one block input) and what the layers keep
    there: with offload, the output whose copy to the host drains; without it, the kept inputs
    and the regained ones but the block's own output (inside the forward's transients)."""
    s, k = saved, layout.checkpoint_segment_blocks
    resident = s.per_layer if layout.offload_activations else s.forward + (k - 2) * s.per_layer
    return s.rope + block_input + resident + max(tr["attn_fwd_nograd"], tr["mlp_fwd_nograd"])


def _norm_backward_phase(layout: Layout, prec: Precision, h: int, n_n: int, saved: _Saved,
                         tr: dict[str, int], norm_tmp: int) -> int:
    """RMSNorm's backward (RmsNormFn): dx in the activation dtype plus the fp32 temporaries of one
    chunk of tokens (`norm_tmp`), on top of what is saved and the incoming gradient: the final
    norm after the loss, or a block's second norm, with the block's attention still saved."""
    e, s = prec.act, saved
    block_input = e * n_n * h
    final = s.forward + s.rope + rms_norm_saved(n_n, h, e, output_kept=False) + block_input
    ac = layout.activation_checkpointing
    in_layer = (s.backward + s.rope - (_shared_block_input(layout, block_input) if ac else s.layer)
                + tr["norm_bwd_in_layer"])
    return max(final, in_layer) + norm_tmp


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
    return _attention_items_bytes(cfg, layout, seq_len, prec)


def _attention_items_bytes(cfg: ModelConfig, layout: Layout, seq_len: int, prec: Precision) -> int:
    """One TSP layer's kept attention items (`tsp_selective_saved`), whatever the mode."""
    n = layout.micro_batch * seq_len // layout.degree
    nh, d = cfg.num_heads, cfg.head_dim
    kv = cfg.kv_shard_hidden(layout.degree) * layout.degree   # every item's K/V heads (copies too)
    # Qwen3's q/k norms: each item also keeps its q and k before the norm (their backward's input)
    norm_inputs = prec.act * n * (nh * d + kv) if cfg.qk_norm else 0
    return prec.act * n * (3 * nh * d + 2 * kv) + 4 * n * nh + norm_inputs


def tsp_mlp_kept(cfg: ModelConfig, layout: Layout, seq_len: int, prec: Precision = BF16) -> int:
    """Bytes per layer and rank that parallel.tsp_recompute=none keeps beyond selective
    (parallel/tsp/mlp.py): per ring step j (weight shard j of D) the gate and up pre-activations
    g = X_p W_gate_j^T (+b) and u = X_p W_up_j^T (+b), each [B T, I/D] in the activation dtype,
    alive from the layer's forward until its MLP backward. Over the D shards: 2 e T I with
    T = B S / D. 0 under full and selective recompute (their backward re-runs gate/up)."""
    if not layout.keeps_mlp:
        return 0
    return _gate_up_bytes(cfg, layout, seq_len, prec)


def _gate_up_bytes(cfg: ModelConfig, layout: Layout, seq_len: int, prec: Precision) -> int:
    """One TSP layer's kept gate/up pre-activations (`tsp_mlp_kept`), whatever the mode."""
    n = layout.micro_batch * seq_len // layout.degree
    return 2 * prec.act * n * cfg.intermediate_size


def tsp_replay_kept(cfg: ModelConfig, layout: Layout, seq_len: int, prec: Precision = BF16,
                    device: str = "cuda") -> tuple[int, int]:
    """(attention, MLP) bytes per rank that a TSP block's replay keeps under activation
    checkpointing (parallel/tsp/kept.py), in every tsp_recompute mode, as far as
    layout.replay_keeps lets it: the attention items of selective (`tsp_selective_saved`; all,
    attention) and the gate/up pre-activations of none (`tsp_mlp_kept`; all only), for one block
    only, alive from its replay until its attention (MLP) backward. A part the replay does not keep
    counts 0 here: its backward recomputes as full recompute does (transients.py). On CUDA's
    memory-efficient route (fp32 + GQA) the kernel's saved K/V are copies expanded to the query
    heads, [B, S, hq_b, d] each per item, kept too: 2 e B S n_h d over the D n_b items (the refusal
    of parallel/tsp/recompute_rules.py concerns every layer's; under AC it is one block's). (0, 0)
    without AC or for the baselines. The replay's forward peak stays below the block's backward
    (fewer weight buffers, no gradient buffers), so no phase of its own is needed."""
    attn = mlp = 0
    if layout.replay_keeps_attention:
        attn = _attention_items_bytes(cfg, layout, seq_len, prec)
        if expands_kv(prec.act, device, cfg.num_heads != cfg.num_kv_heads):
            attn += 2 * prec.act * layout.micro_batch * seq_len * cfg.num_heads * cfg.head_dim
    if layout.replay_keeps_mlp:
        mlp = _gate_up_bytes(cfg, layout, seq_len, prec)
    return attn, mlp


__all__ = ["ActivationEstimate", "activation_memory", "loss_chunk", "mlp_chunk",
           "norm_backward_chunk_bytes", "tsp_mlp_kept", "tsp_replay_kept", "tsp_selective_saved"]
