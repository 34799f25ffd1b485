"""The FLOPs a layout executes: which forward pieces it runs again (activation checkpointing's
replay, TSP's own recompute, the vocab ring's rebuilt logits, context attention's core), handed to
the one FLOP count, observability/flops.py `flops_per_token` (pieces, model and hardware FLOPs);
equal to torch's FLOP counter on the dry run's fake tensors within 2%, every scheme and mode
(tests/unit/test_plan_flops.py).

* forward runs (`forward_runs`) = 1, + 1 for each time the layout re-runs that piece: activation
  checkpointing replays the block once in backward (`checkpoint_replay`: every piece under TSP,
  all but down elsewhere); without checkpointing TSP's own recompute re-runs qkv and core
  (tsp_recompute=full) and gate_up (full and selective) inside its backward (under checkpointing
  the replay is that recompute: what it keeps serves the block's backward, and what
  checkpoint_replay_keeps does not let it keep runs a third time there: gate_up under attention;
  qkv, core and gate_up under nothing), and its vocab-parallel loss rebuilds the logits (head);
  SP-style context attention (S_p > 1 outside TSP) re-runs the core in its backward;
* backward cost = 2 for a GEMM (dX and dW) and 2.5 for the attention core: the flash backward
  rebuilds the scores (Q K^T once more) before dP, dV, dQ, dK (tools/flop_count.py).
"""

from __future__ import annotations

from tsp_trainer.config import ModelConfig, TrainConfig
from tsp_trainer.observability.flops import (BACKWARD_COST, BLOCK_PIECES, PIECES, flops_per_token,
                                              forward_pieces, piece_flops)
from tsp_trainer.plan.layout import Layout, planned_scheme


def forward_runs(layout: Layout, tiled: frozenset[str] = frozenset(), cfg_layers: int = 0) -> dict[str, float]:
    """How many times one micro-step runs each piece's forward under `layout` (module docstring).
    tiled: which of a baseline's "mlp" and "loss" take their tokens in chunks (`baseline_tiling`).
    cfg_layers: the model's layers, for nested checkpointing's extra forwards (a fraction of a
    run per block piece: `nested_forward_share`; 0 = no nesting counted)."""
    runs = dict.fromkeys(PIECES, 1)
    tsp = layout.scheme == "tsp"
    if layout.activation_checkpointing:
        for piece in checkpoint_replay(layout, tiled):
            runs[piece] += 1
        nested = nested_forward_share(layout, cfg_layers)
        if nested:                                   # each segment re-runs all but its last block
            for piece in BLOCK_PIECES:
                runs[piece] += nested
    if not tsp and "mlp" in tiled:                   # a tiled MLP saves only its input
        runs["gate_up"] += 1
    if not tsp and "loss" in tiled:                  # a tiled loss rebuilds each chunk's logits
        runs["head"] += 1
    _, s_p, _ = layout.axes
    if tsp:
        runs["head"] += 1                            # the vocab ring rebuilds each logits block
        # TSP's backward re-runs from X_p what is not kept for it: without checkpointing what its
        # mode does not keep; under checkpointing what the replay does not keep (replay_keeps)
        ac = layout.activation_checkpointing
        if not (layout.replay_keeps_attention if ac else layout.keeps_attention):
            runs["qkv"] += 1
            runs["core"] += 1
        if not (layout.replay_keeps_mlp if ac else layout.keeps_mlp):
            runs["gate_up"] += 1
    elif s_p > 1:                                    # context attention recomputes its core
        runs["core"] += 1
    return runs


def nested_forward_share(layout: Layout, num_layers: int) -> float:
    """The share of the L blocks nested checkpointing (checkpoint_segment_blocks k > 1) runs
    forward once more: (L - ceil(L / k)) / L, 0 without nesting."""
    if num_layers < 1 or not layout.activation_checkpointing or layout.checkpoint_segment_blocks == 1:
        return 0
    return layout.nested_forward_blocks(num_layers) / num_layers


def checkpoint_replay(layout: Layout, tiled: frozenset[str] = frozenset()) -> tuple[str, ...]:
    """The pieces activation checkpointing's replay runs again. Non-reentrant checkpointing stops
    the replay once it has rebuilt the last tensor backward needs: in the plain block that is the
    down projection's input, so down itself is not replayed. TSP's MLP is one autograd Function
    (the ring), whose forward the replay runs whole; so is a baseline's tiled MLP."""
    if layout.scheme == "tsp" or "mlp" in tiled:
        return BLOCK_PIECES
    return tuple(p for p in BLOCK_PIECES if p != "down")


def baseline_tiling(cfg: ModelConfig, layout: Layout, seq_len: int, bytes_per_element: int = 2,
                    *, mlp_chunk_tokens: int | str = "auto", loss_chunk_tokens: int | str = "auto",
                    attention_chunk_tokens: int | str = "auto") -> frozenset[str]:
    """Which of a baseline's MLP and loss take their local tokens in chunks (the blocks' own rule,
    plan/activations.py); TSP's recompute does not change with its chunks (empty set), nor with
    its K/V chunks (`attention_chunk_tokens`: the same attention FLOPs in more calls)."""
    from tsp_trainer.plan.activations import loss_chunk, mlp_chunk, region_tokens
    from tsp_trainer.plan.precision import PRECISIONS

    if layout.scheme == "tsp":
        return frozenset()
    tokens = region_tokens(layout, seq_len)
    prec = next(p for p in PRECISIONS.values() if p.act == bytes_per_element)
    chunks = {"mlp": mlp_chunk(cfg, layout, tokens, prec, mlp_chunk_tokens),
              "loss": loss_chunk(cfg, layout, tokens, loss_chunk_tokens)}
    return frozenset(k for k, chunk in chunks.items() if chunk < tokens["region"])


def executed_pieces(cfg: ModelConfig, layout: Layout, seq_len: int, bytes_per_element: int = 2,
                    chunks: dict | None = None) -> dict[str, float]:
    """Executed FLOPs per token of each piece: f * (forward runs + backward cost). chunks: the
    run's mlp_chunk_tokens / loss_chunk_tokens settings (default auto)."""
    return piece_flops(cfg, seq_len, recompute=recompute_runs(cfg, layout, seq_len, bytes_per_element, chunks))


def executed_by_family(cfg: ModelConfig, layout: Layout, seq_len: int,
                       bytes_per_element: int = 2, chunks: dict | None = None) -> dict[str, float]:
    """Per token, the work of each kernel family the planner times (plan/efficiency.py): FLOPs of
    GEMMs, of the flash attention forward (every run of the core) and backward, and the HBM bytes
    of the memory-bound elementwise kernels (`elementwise_bytes_per_token`). chunks: as
    `executed_pieces`."""
    tiled = baseline_tiling(cfg, layout, seq_len, bytes_per_element, **(chunks or {}))
    f, runs = forward_pieces(cfg, seq_len), forward_runs(layout, tiled, cfg.num_layers)
    gemm = sum(v for p, v in executed_pieces(cfg, layout, seq_len, bytes_per_element, chunks).items()
               if p != "core")
    return {"gemm": gemm, "attention_forward": f["core"] * runs["core"],
            "attention_backward": f["core"] * BACKWARD_COST["core"],
            "elementwise_bytes": (elementwise_bytes_per_token(cfg, layout, bytes_per_element)
                                  + norm_handoff_bytes_per_token(cfg, layout, seq_len, bytes_per_element,
                                                                 chunks))}


def elementwise_bytes_per_token(cfg: ModelConfig, layout: Layout, bytes_per_element: int = 2) -> float:
    """HBM bytes per token of the memory-bound kernels, an estimate: per layer and forward pass two
    RMSNorms (read + write h each), two residual adds (read 2 h, write h), RoPE on q and k (read +
    write), SwiGLU (read gate and up, write I): 10 h + 2 (H d + kv) + 3 I elements; backward about
    twice a forward; the AC replay one forward more. The loss's fp32 logits: written, read by the
    softmax, their gradient written: 3 V x 4 bytes."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    per_pass = 10 * h + 2 * (cfg.num_heads * cfg.head_dim + cfg.kv_hidden_size) + 3 * inter
    passes = 3 + (1 if layout.activation_checkpointing else 0) + nested_forward_share(layout, cfg.num_layers)
    return float(cfg.num_layers * per_pass * passes * bytes_per_element + 3 * cfg.vocab_size * 4)


def norm_handoff_bytes_per_token(cfg: ModelConfig, layout: Layout, seq_len: int,
                                 bytes_per_element: int = 2, chunks: dict | None = None) -> float:
    """HBM bytes per token of the norm applications a tiled TSP layer adds when its norms hand
    their work over (parallel/tsp/norm.py), in `elementwise_bytes_per_token`'s units (an
    application reads and writes h): in a forward that keeps its tensors (the forward, or the
    replay under checkpointing) each consumer applies its norm once per owner or ring step, D in
    all, instead of the norm's once; in backward the MLP D times, the attention D times for
    dW_qkv and D more where it recomputes its projections (full recompute: no items kept, by the
    mode or the replay). The first forward of a checkpointed block applies each norm once."""
    from tsp_trainer.plan.activations import mlp_chunk, region_tokens
    from tsp_trainer.plan.precision import PRECISIONS
    from tsp_trainer.plan.transients import tsp_norms_handed_over

    if layout.scheme != "tsp":
        return 0.0
    tokens = region_tokens(layout, seq_len)
    prec = next(p for p in PRECISIONS.values() if p.act == bytes_per_element)
    chunk = mlp_chunk(cfg, layout, tokens, prec, (chunks or {}).get("mlp_chunk_tokens", layout.mlp_chunk_tokens))
    if not tsp_norms_handed_over(layout, tokens["region"], chunk):
        return 0.0
    d = layout.degree
    items_kept = (layout.replay_keeps in ("all", "attention") if layout.activation_checkpointing
                  else layout.tsp_recompute != "full")
    applications = 2 * (d - 1) + d + d + (0 if items_kept else d)
    return float(cfg.num_layers * applications * 2 * cfg.hidden_size * bytes_per_element)


def recompute_runs(cfg: ModelConfig, layout: Layout, seq_len: int, bytes_per_element: int = 2,
                   chunks: dict | None = None) -> dict[str, int]:
    """The forward re-runs of each piece under `layout` (`forward_runs` - 1): the `recompute`
    argument of observability/flops.py `flops_per_token`. chunks: as `executed_pieces`."""
    tiled = baseline_tiling(cfg, layout, seq_len, bytes_per_element, **(chunks or {}))
    return {p: runs - 1 for p, runs in forward_runs(layout, tiled, cfg.num_layers).items()}


def hardware_flops_per_token(cfg: ModelConfig, layout: Layout, seq_len: int,
                             bytes_per_element: int = 2, chunks: dict | None = None) -> dict[str, float]:
    """{"model": the MFU numerator, "hardware": what the layout executes (the HFU numerator)}
    per training token; bytes_per_element (the activations') and chunks (`executed_pieces`) decide
    whether a baseline's MLP and loss are tiled."""
    recompute = recompute_runs(cfg, layout, seq_len, bytes_per_element, chunks)
    return {"model": flops_per_token(cfg, seq_len), "hardware": flops_per_token(cfg, seq_len, recompute=recompute)}


def run_flops_layout(cfg: TrainConfig) -> Layout:
    """The layout of a training run, as far as its FLOPs go: scheme, degrees, activation
    checkpointing, TSP's head buckets and recompute mode (not ZeRO or batch: they change no FLOP
    per token)."""
    p = cfg.parallel
    unresolved = [k for k, v in (("train.activation_checkpointing", cfg.train.activation_checkpointing),
                                 ("parallel.tsp_recompute", p.tsp_recompute),
                                 ("parallel.checkpoint_replay_keeps",
                                  p.checkpoint_replay_keeps if cfg.train.activation_checkpointing else None),
                                 ("train.checkpoint_segment_blocks", cfg.train.checkpoint_segment_blocks),
                                 ("train.offload_activations", cfg.train.offload_activations),
                                 ("parallel.head_buckets", p.head_buckets)) if v == "auto"]
    if unresolved:
        raise ValueError(f"{', '.join(unresolved)}=auto: the FLOPs need the resolved layout "
                         "(plan/auto.py resolves it before the run is built)")
    axes = {"tp": p.tp_degree, "sp": p.sp_degree} if p.scheme == "tp_x_sp" else {}
    tsp = p.scheme == "tsp"
    return Layout(planned_scheme(p.scheme), p.tsp_degree, activation_checkpointing=cfg.train.activation_checkpointing,
                  offload_activations=cfg.train.offload_activations,
                  checkpoint_segment_blocks=cfg.train.checkpoint_segment_blocks
                  if cfg.train.activation_checkpointing else 1,
                  head_buckets=p.head_buckets if tsp else 1,
                  tsp_recompute=p.tsp_recompute if tsp else "full",
                  replay_keeps=p.checkpoint_replay_keeps if tsp and cfg.train.activation_checkpointing
                  else "all", **axes)


def run_recompute(cfg: TrainConfig, model_cfg: ModelConfig, seq_len: int) -> dict[str, int]:
    """The forward re-runs of a run of `cfg` (no `auto` left) at `seq_len`: the argument of
    `flops_per_token` for the HFU the trainer logs."""
    p = cfg.parallel
    return recompute_runs(model_cfg, run_flops_layout(cfg), seq_len,
                          bytes_per_element=2 if cfg.train.dtype == "bf16" else 4,
                          chunks={"mlp_chunk_tokens": p.mlp_chunk_tokens,
                                  "loss_chunk_tokens": p.loss_chunk_tokens})


__all__ = ["BACKWARD_COST", "BLOCK_PIECES", "PIECES", "checkpoint_replay", "elementwise_bytes_per_token",
           "norm_handoff_bytes_per_token",
           "executed_by_family", "executed_pieces", "forward_pieces",
           "forward_runs", "hardware_flops_per_token", "nested_forward_share", "recompute_runs", "run_flops_layout", "run_recompute"]
