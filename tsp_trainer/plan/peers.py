"""The peers' layouts, as the planner models them: the stacks people choose instead of TSP for 7-8B
models at 128K to millions of tokens, modelled on their own layer (the Hugging Face Llama layer
with Liger's kernels that ALST runs, torch's for FSDP + CP), their tiling and their offloads. The
trainer runs each on its own model code: `ulysses` as parallel.scheme=ulysses, `upipe` as ulysses
with parallel.ulysses_head_chunks, `sp_zero3` as parallel.scheme=sp, both under ZeRO-3 (zero.stage
auto), with CPU Adam when zero.offload_optimizer=cpu; its `auto` plans those runs with this
module's ZeRO-3 state and head-chunk terms, the optimizer on the device
(plan/state.py zero3_state_bytes, `head_chunk_saving`). Every label carries PEER_STACK.

    ulysses    the DeepSpeed ALST stack: Ulysses sequence parallelism over the model-parallel axis
               (all-to-all from sequence to heads before attention and back after: q, k, v and o,
               4 per layer in forward, 4 more in backward, 4 more in the checkpoint replay),
               ZeRO-3 over every rank (bf16 weights, gradients and AdamW state sharded over the
               world; per layer an all-gather of its weights in forward and again in backward,
               a reduce-scatter of its gradients), CPU Adam (optimizer offload), tiled MLP,
               tiled logits + loss, activation checkpointing with the checkpointed block inputs
               optionally offloaded to host memory
    upipe      ulysses with head chunks ("Untied Ulysses"), the trainer's parallel.scheme=ulysses
               with parallel.ulysses_head_chunks = c > 1 (parallel/ulysses.py): after the
               all-to-all, attention runs over one group of local heads at a time, so the
               full-sequence q/k/v/o of all local heads never exist at once (the attention's
               post-all-to-all memory divided by c). A chunk keeps only its local inputs for
               backward, which replays its all-to-alls and attention forward: one more forward's
               all-to-all bytes and attention forward FLOPs per step
    sp_zero3   FSDP + context parallelism: the `sp` scheme's all-gather attention (K/V gathered over
               the axis, dK/dV reduce-scattered) with ZeRO-3 weights, gradients and optimizer state

Memory per rank, with n = B S / D local tokens, e the activation dtype's bytes, h the hidden size,
I the MLP's, V the vocabulary (docs/planner.md, "The peers", lists the terms):

    HBM   bf16 weight shard 2 N / W; fp32 gradient partition 4 N / W and AdamW's fp32 master and
          moments 12 N / W (both in host memory under CPU Adam); the gathered layer weights (the
          layer in use and the one prefetched, bf16) and the layer's bf16 gradients before their
          reduce-scatter; the checkpointed block inputs e n h per layer (in host memory when
          offloaded, one on the GPU); one layer's recomputed activations and its backward's
          transients (`_layer_terms`); the logits and loss (`_head_bytes`); NCCL, cuBLAS and CUDA
          context (plan/reserved.py)
    host  offloaded block inputs L e n h per rank; CPU Adam's pinned partition (fp32 master,
          two moments, the fp32 gradient partition and the bf16 copy sent back, 18 N / W bytes)

The layer model is that of the Hugging Face Llama layer ALST runs: RMSNorm keeps its fp32 input and
the bf16 normalised input beside its output; the projections keep their inputs; attention (flash)
keeps q, k, v, its output and log-sum-exp after the all-to-all; o_proj keeps its input; the untiled
MLP keeps gate, up, silu(gate) and their product ([n, I] each), the tiled MLP only its input.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from tsp_trainer.config import ModelConfig
from tsp_trainer.config.validate import ulysses_head_chunk_counts
from tsp_trainer.plan.activations import ActivationEstimate
from tsp_trainer.plan.hardware import HardwareProfile
from tsp_trainer.plan.layout import UNTILED, Layout
from tsp_trainer.plan.precision import BF16, Precision
from tsp_trainer.plan.predict import (CPU_ADAM_BYTES, Assumptions, Prediction, compute_seconds_per_token,
                                      efficiencies, exceeded_limits, host_bytes_per_node)
from tsp_trainer.plan.reserved import ReserveAssumptions, flash_gqa_dkv_expanded_bytes, nccl_buffer_bytes
from tsp_trainer.plan.state import FP32_BYTES, zero3_gathered_bytes, zero3_state_bytes

PEER_SCHEMES = ("ulysses", "upipe", "sp_zero3")
PEER_STACK = "peer stack"
# the trainer's settings that run each peer's layout on our model code
TRAINER_RUNS = {"ulysses": "parallel.scheme=ulysses",
                "upipe": "parallel.scheme=ulysses, parallel.ulysses_head_chunks > 1",
                "sp_zero3": "parallel.scheme=sp (zero.stage auto: 3)"}


@dataclass(frozen=True)
class PeerLayout:
    """One peer's layout: the scheme, its sequence-parallel degree D (Ulysses or CP over the
    model-parallel axis), DP replicas (ZeRO-3 shards over all D x DP ranks) and the memory tools."""

    scheme: str
    degree: int
    dp: int = 1
    activation_checkpointing: bool = True
    offload_optimizer: bool = False         # CPU Adam (ZeRO-Offload)
    offload_block_inputs: bool = False      # checkpointed block inputs in host memory
    tiled_loss: bool = True                 # fused tiled logits + loss (Liger's chunking)
    tiled_mlp: bool = True                  # TiledMLP: ceil(n / h) shards
    head_chunks: int = 1                    # upipe: local heads run in this many groups
    micro_batch: int = 1
    grad_accum: int = 1

    def __post_init__(self) -> None:
        if self.scheme not in PEER_SCHEMES:
            raise ValueError(f"scheme={self.scheme!r} is not a peer; use one of {', '.join(PEER_SCHEMES)}")
        if self.degree < 1 or self.dp < 1:
            raise ValueError(f"degree={self.degree}, dp={self.dp}: both must be >= 1")
        if (self.scheme == "upipe") != (self.head_chunks > 1):
            raise ValueError(f"head_chunks={self.head_chunks} with scheme {self.scheme!r}: upipe runs "
                             "2 or more head chunks, the other peers 1")
        if self.offload_block_inputs and not self.activation_checkpointing:
            raise ValueError("offload_block_inputs needs activation_checkpointing: the offloaded "
                             "tensors are the checkpointed block inputs")

    @property
    def liger_kernels(self) -> bool:
        """ALST's model factory loads Liger's RMSNorm, RoPE and (with the MLP untiled) SwiGLU
        kernels, and upipe is that stack with head chunks; FSDP + CP runs torch's."""
        return self.scheme in ("ulysses", "upipe")

    # the fields the report and the longest-sequence search read from every layout
    zero_stage = 3
    head_buckets = 1
    tsp_recompute = "full"

    @property
    def offload_activations(self) -> bool:
        return self.offload_block_inputs

    @property
    def world(self) -> int:
        return self.degree * self.dp

    def label(self) -> str:
        parts = [f"{self.scheme} ({PEER_STACK})", f"D={self.degree}", f"DP={self.dp}",
                 "Z3" + ("+cpuopt" if self.offload_optimizer else ""),
                 "AC" if self.activation_checkpointing else "noAC"]
        if self.head_chunks > 1:                # parallel.ulysses_head_chunks
            parts.append(f"head_chunks={self.head_chunks}")
        parts.append(f"mb={self.micro_batch}x{self.grad_accum}")
        if self.offload_block_inputs:
            parts.append("offload")
        parts += [f"{name}=untiled" for name, tiled in (("loss", self.tiled_loss), ("mlp", self.tiled_mlp))
                  if not tiled]
        return " ".join(parts)

    def as_dict(self) -> dict:
        return {**asdict(self), "peer_stack": True, "trainer_runs": TRAINER_RUNS[self.scheme]}


def peer_shapes_ok(cfg: ModelConfig, scheme: str, degree: int, seq_len: int) -> str:
    """'' when `scheme` can run at `degree` and seq_len, else why not (the rules the trainer will
    enforce: Ulysses splits the q heads over D and the sequence over D; context parallelism's
    zigzag needs the sequence in 2 D equal runs)."""
    if scheme in ("ulysses", "upipe") and cfg.num_heads % degree:
        return f"q heads {cfg.num_heads} not divisible by D={degree}"
    runs = 2 * degree if scheme == "sp_zero3" and degree > 1 else degree
    if seq_len % runs:
        return f"sequence {seq_len} not divisible by {runs}"
    return ""


def _n_params(cfg: ModelConfig) -> int:
    return cfg.num_params()


def _kv_heads_local(cfg: ModelConfig, lay: PeerLayout) -> int:
    """K/V heads a Ulysses rank holds after the all-to-all: KV heads fewer than D are replicated
    (DeepSpeed repeats them before the all-to-all), so each rank gets at least one."""
    return max(cfg.num_kv_heads // lay.degree, 1)


def loss_chunk_tokens(cfg: ModelConfig, n: int) -> int:
    """Liger's fused linear cross-entropy chunk: next power of two of ceil(n / ceil(V / h))."""
    chunks = -(-cfg.vocab_size // cfg.hidden_size)
    return min(n, 1 << max(0, (-(-n // chunks) - 1).bit_length()))


def mlp_chunk_tokens(cfg: ModelConfig, n: int) -> int:
    """TiledMLP's shard: ceil(n / h) shards of the local tokens."""
    shards = max(1, -(-n // cfg.hidden_size))
    return -(-n // shards)


def _attention_bytes(cfg: ModelConfig, lay: PeerLayout, seq_len: int, e: int) -> dict[str, int]:
    """Per-rank bytes of the attention's post-all-to-all (ulysses, upipe) or gathered (sp_zero3)
    tensors, for the head chunk alive at once: q, the K/V pair, one q-sized tensor (output, its
    gradient, dq), the fp32 log-sum-exp, FA2's fp32 dQ accumulator and, under GQA, its dK/dV per
    query head."""
    b, d, hd = lay.micro_batch, lay.degree, cfg.head_dim
    n = b * seq_len // d
    if lay.scheme == "sp_zero3":
        heads, kv_heads, q_tokens = cfg.num_heads, cfg.num_kv_heads, n
    else:
        c = lay.head_chunks
        heads, kv_heads, q_tokens = cfg.num_heads // d // c, max(_kv_heads_local(cfg, lay) // c, 1), b * seq_len
    kv_tokens = b * seq_len
    return {"q": e * q_tokens * heads * hd, "kv": 2 * e * kv_tokens * kv_heads * hd,
            "lse": 4 * q_tokens * heads, "dq_accum": 4 * q_tokens * heads * hd,
            "gqa_dkv": flash_gqa_dkv_expanded_bytes(1, kv_tokens, heads, kv_heads, hd, e)}


def _layer_terms(cfg: ModelConfig, lay: PeerLayout, seq_len: int, prec: Precision) -> dict[str, int]:
    """One layer's saved bytes (`saved`: what a forward with autograd keeps, also what the
    checkpoint replay brings back) and its phases' transients on top of them, per rank."""
    e, h, inter = prec.act, cfg.hidden_size, cfg.intermediate_size
    n = lay.micro_batch * seq_len // lay.degree
    u = e * n * h                                       # one [n, h] activation
    liger = lay.liger_kernels
    # RMSNorm: Liger's keeps its input and output (and an fp32 [n] rstd); torch's (Hugging Face's
    # LlamaRMSNorm) its fp32 input, the normalised input and the output
    norm = 2 * u if liger else 2 * u + u + u
    a = _attention_bytes(cfg, lay, seq_len, e)
    # flash keeps q, k, v, its output and log-sum-exp; o_proj its input (the output sent back)
    post = a["q"] + a["kv"] + a["q"] + a["lse"]
    # each chunk's output lands in the [n, hq] buffer o_proj keeps. upipe: a chunk keeps its local
    # q, k, v (all chunks: [n, hq + 2 hkv]), not its post-all-to-all tensors; its backward replays
    # them (`_attention_bytes` counts one chunk's)
    chunked = lay.head_chunks > 1
    attn_saved = e * n * cfg.q_hidden_size + (e * n * (cfg.q_hidden_size + 2 * cfg.kv_hidden_size) if chunked else post)
    replayed = post if chunked else 0
    mid = e * n * inter
    # untiled: gate, up and silu(gate) * up (Liger's SiLU-mul recomputes silu in backward), torch's
    # silu(gate) as well; tiled: only the MLP's input (the norm's output, counted)
    mlp_saved = 0 if lay.tiled_mlp else (3 if liger else 4) * mid
    saved = 2 * norm + attn_saved + mlp_saved
    # backward of attention: dy, d(o_proj input); post-all-to-all d(out), dq, dk, dv, FA2's fp32 dQ
    # accumulator and GQA dK/dV per query head; then dq/dk/dv all-to-all'd back (local; sp_zero3:
    # dK/dV reduce-scattered, the local dq in place)
    flash_bwd = a["q"] + a["q"] + a["kv"] + a["dq_accum"] + a["gqa_dkv"]
    local_grads = e * n * (cfg.q_hidden_size + 2 * _kv_heads_local(cfg, lay) * lay.degree * cfg.head_dim) \
        if lay.scheme != "sp_zero3" else e * n * (cfg.q_hidden_size + 2 * cfg.kv_hidden_size)
    # all_to_all_single sends from one buffer into another: the post-all-to-all gradients and
    # their local copy are alive together
    attn_bwd = norm + attn_saved + replayed + 2 * u + flash_bwd + (local_grads if lay.degree > 1 else 0)
    # backward of the MLP: dy and dX; untiled d(product), d(silu), d(up) then d(gate) ([n, I] each,
    # two alive with the saved ones), tiled one shard's gate/up re-run and its gradients (8 [m, I])
    if lay.tiled_mlp:
        m = mlp_chunk_tokens(cfg, n)
        mlp_bwd = saved + 2 * u + 8 * e * m * inter
        mlp_fwd = 3 * e * m * inter
    else:
        # Liger's backward writes d(gate), d(up) over gate and up: only d(product) is new
        mlp_bwd = saved + 2 * u + (1 if liger else 2) * mid
        mlp_fwd = 3 * mid
    attn_fwd = a["q"] + a["kv"] + a["q"] + e * n * (cfg.q_hidden_size + 2 * cfg.kv_hidden_size)
    return {"saved": saved, "attn_saved": attn_saved, "mlp_saved": mlp_saved, "attn_bwd": attn_bwd,
            "mlp_bwd": mlp_bwd, "fwd_nograd": 2 * u + max(attn_fwd, mlp_fwd), "flash_backward": flash_bwd}


def _head_bytes(cfg: ModelConfig, lay: PeerLayout, n: int, prec: Precision) -> int:
    """The logits and loss at their peak. Tiled (Liger's fused linear cross-entropy): one chunk's
    fp32 logits and their bf16 source, dX [n, h], the weight's gradient. Whole (Hugging Face's
    loss): the bf16 logits (returned to the caller), their fp32 copy, the fp32 log-softmax the loss
    keeps and, in backward, its fp32 gradient, with dX."""
    e, h, V = prec.act, cfg.hidden_size, cfg.vocab_size
    if lay.tiled_loss:
        c = loss_chunk_tokens(cfg, n)
        return (4 + e) * c * V + e * n * h + e * V * h
    return (e + 4 + 4 + 4) * n * V + e * n * h


def peer_memory(cfg: ModelConfig, lay: PeerLayout, seq_len: int, prec: Precision = BF16,
                reserve: ReserveAssumptions = ReserveAssumptions()) -> tuple[dict, ActivationEstimate]:
    """Per-rank HBM terms (the keys of Prediction.memory) and the activation estimate."""
    e, h, L = prec.act, cfg.hidden_size, cfg.num_layers
    n_all, world = _n_params(cfg), lay.world
    n = lay.micro_batch * seq_len // lay.degree
    state = zero3_state_bytes(n_all, world, prec, offload_optimizer=lay.offload_optimizer)
    params, grads, optimizer = state["params"], state["grads"], state["optimizer"]
    host_optimizer = state["host_optimizer"]
    # the layer in use and the one prefetched (bf16), and in backward the layer's bf16 gradients
    # before their reduce-scatter; the embedding / LM head gathered for the loss
    gathered_fwd, gathered_bwd = zero3_gathered_bytes(cfg, prec)
    head_w = cfg.vocab_size * h * prec.weight
    lt = _layer_terms(cfg, lay, seq_len, prec)
    block_in = e * n * h
    if lay.activation_checkpointing:
        per_layer = block_in
        on_gpu = block_in if lay.offload_block_inputs else L * block_in
        host = L * block_in if lay.offload_block_inputs else 0
        fwd = on_gpu + gathered_fwd + lt["fwd_nograd"]
        bwd = on_gpu + gathered_bwd + max(lt["attn_bwd"], lt["mlp_bwd"])
    else:
        per_layer, host = lt["saved"], 0
        on_gpu = L * lt["saved"]
        fwd = on_gpu + gathered_fwd
        bwd = on_gpu - lt["saved"] + gathered_bwd + max(lt["attn_bwd"], lt["mlp_bwd"])
    outside = 2 * 4 * n * h                                     # final norm's fp32 input, output
    head = on_gpu + outside + head_w + _head_bytes(cfg, lay, n, prec)
    phases = {"forward": fwd, "backward": bwd, "loss": head}
    peak_phase = max(phases, key=phases.get)
    terms = {"block_input": block_in, "layer_saved": lt["saved"], "attention_saved": lt["attn_saved"],
             "mlp_saved": lt["mlp_saved"], "attention_backward": lt["attn_bwd"],
             "mlp_backward": lt["mlp_bwd"], "flash_backward": lt["flash_backward"],
             "gathered_weights_backward": gathered_bwd, "head": _head_bytes(cfg, lay, n, prec),
             "host_offloaded": host}
    act = ActivationEstimate(stored_per_layer=per_layer, stored_outside=outside, stored=on_gpu + outside,
                             phases=phases, peak=phases[peak_phase], peak_phase=peak_phase, terms=terms,
                             host=host)
    comms = 1 + (lay.degree > 1) + (lay.dp > 1)
    reserved = {"nccl_buffers": nccl_buffer_bytes(comms, reserve),
                "blas_workspaces": 2 * reserve.blas_workspace * reserve.gemm_streams,
                "cuda_context": reserve.cuda_context}
    total = params + grads + optimizer + act.peak + sum(reserved.values())
    memory = {"params": params, "grads": grads, "optimizer": optimizer, "activations_peak": act.peak,
              "reserved": sum(reserved.values()), "reserved_terms": reserved, "total": total,
              "host_offloaded": host, "host_optimizer": host_optimizer,
              "checkpoint_staging": params + optimizer}
    return memory, act


def _proxy(lay: PeerLayout, n: int, cfg: ModelConfig) -> Layout:
    """The one-GPU layout whose work, divided by D, is a peer rank's: every rank runs 1/D of each
    layer's FLOPs (Ulysses: all tokens of 1/D of the heads; CP: 1/D of the tokens against the
    causal prefix, zigzag-balanced), with the same checkpointing and tiling (a tiled MLP re-runs
    gate/up in backward, a tiled loss its logits). The peers' attention is SDPA's fused GQA call
    (attention_gqa fused: no GQA-native slowdown)."""
    return Layout("tp", 1, dp=lay.dp, activation_checkpointing=lay.activation_checkpointing, attention_gqa="fused",
                  micro_batch=lay.micro_batch, grad_accum=lay.grad_accum,
                  loss_chunk_tokens=loss_chunk_tokens(cfg, n) * lay.degree if lay.tiled_loss else UNTILED,
                  mlp_chunk_tokens=mlp_chunk_tokens(cfg, n) * lay.degree if lay.tiled_mlp else UNTILED)


def head_chunk_saving(cfg: ModelConfig, layout: Layout, seq_len: int, chunks: int, prec: Precision = BF16) -> int:
    """Bytes per rank that `chunks` head chunks (parallel.ulysses_head_chunks) take off the peak of
    a ulysses run planned as `layout` (layout.planned_scheme: sp): the peers' model of ulysses less
    that of upipe with `chunks`, at the run's D, DP, micro-batch, checkpointing, offloads and
    tiling (0 for one chunk or D = 1)."""
    if chunks == 1 or layout.degree == 1:
        return 0
    kw = dict(dp=layout.dp, activation_checkpointing=layout.activation_checkpointing,
              offload_optimizer=layout.offload_optimizer,
              offload_block_inputs=layout.offload_activations and layout.activation_checkpointing,
              tiled_loss=layout.loss_chunk_tokens != UNTILED, tiled_mlp=layout.mlp_chunk_tokens != UNTILED,
              micro_batch=layout.micro_batch)
    whole, _ = peer_memory(cfg, PeerLayout("ulysses", layout.degree, **kw), seq_len, prec)
    chunked, _ = peer_memory(cfg, PeerLayout("upipe", layout.degree, head_chunks=chunks, **kw), seq_len, prec)
    return max(0, whole["total"] - chunked["total"])


def _link(group: int, hw: HardwareProfile) -> float:
    return hw.intra_node_bw if group <= hw.gpus_per_node else hw.inter_node_bw


def peer_comm_seconds(cfg: ModelConfig, lay: PeerLayout, seq_len: int, hw: HardwareProfile,
                      assumptions: Assumptions, prec: Precision = BF16) -> dict[str, float]:
    """Per micro-step seconds: the sequence-parallel collectives (exposed: DeepSpeed's all-to-alls
    and the CP K/V gathers run on the compute stream between the layer's kernels) and ZeRO-3's
    weight gathers and gradient reduce-scatters (prefetched and bucketed: overlappable)."""
    e, L, d, eff = prec.act, cfg.num_layers, lay.degree, assumptions.comm_efficiency
    n = lay.micro_batch * seq_len // d
    # forward, backward, the checkpoint replay, upipe's replay of each chunk in backward
    passes = 2 + int(lay.activation_checkpointing) + int(lay.head_chunks > 1)
    sp_bytes, sp_ops = 0.0, 0
    if d > 1 and lay.scheme in ("ulysses", "upipe"):
        kv = 2 * _kv_heads_local(cfg, lay) * d * cfg.head_dim  # K/V heads replicated up to D
        sp_bytes = passes * L * e * n * (2 * cfg.q_hidden_size + kv) * (d - 1) / d
        sp_ops = passes * L * 4 * lay.head_chunks
    elif d > 1:
        # K/V gathered in forward and replay, dK/dV reduce-scattered in backward
        sp_bytes = passes * L * 2 * e * lay.micro_batch * seq_len * cfg.kv_hidden_size * (d - 1) / d
        sp_ops = passes * L
    world = lay.world
    z3 = 0.0
    if world > 1:
        # per micro-step: every layer's bf16 weights gathered twice, its bf16 gradients scattered
        z3 = 3 * _n_params(cfg) * prec.weight * (world - 1) / world / (_link(world, hw) * eff)
    exposed = sp_bytes / (_link(d, hw) * eff) + sp_ops * assumptions.op_latency_s
    return {"exposed_sp": exposed, "zero3": z3, "sp_bytes": sp_bytes}


def predict_peer(cfg: ModelConfig, lay: PeerLayout, seq_len: int, hw: HardwareProfile, *,
                 global_batch: int | None = None, prec: Precision = BF16,
                 assumptions: Assumptions = Assumptions()) -> Prediction:
    """Memory and step time of one optimizer step of a peer layout (its stack as modelled here)."""
    from tsp_trainer.plan.flops import forward_pieces, hardware_flops_per_token

    memory, act = peer_memory(cfg, lay, seq_len, prec)
    gpus_on_node = min(lay.world, hw.gpus_per_node)
    memory["host_optimizer_per_node"] = memory["host_optimizer"] * gpus_on_node
    memory["host_per_node"] = host_bytes_per_node(memory, gpus_on_node)
    capacity = hw.hbm_bytes * assumptions.hbm_usable
    limits = exceeded_limits(memory, capacity, hw.host_memory_bytes)
    n = lay.micro_batch * seq_len // lay.degree
    proxy = _proxy(lay, n, cfg)
    model = cfg.replace(max_seq_len=max(cfg.max_seq_len, seq_len))
    t_compute = compute_seconds_per_token(model, proxy, seq_len, hw, assumptions, prec) * lay.micro_batch \
        * seq_len / lay.degree
    flops = hardware_flops_per_token(model, proxy, seq_len, prec.act, chunks=proxy.chunks)
    if lay.head_chunks > 1:             # upipe: each chunk's attention forward again in backward
        core = forward_pieces(model, seq_len)["core"]
        flops = {**flops, "hardware": flops["hardware"] + core}
        t_compute += core / (hw.peak_flops * efficiencies(hw, assumptions).attention_forward) \
            * lay.micro_batch * seq_len / lay.degree
    comm = peer_comm_seconds(cfg, lay, seq_len, hw, assumptions, prec)
    # ALST copies the block inputs to and from the host synchronously: exposed
    t_offload = 2 * act.host / (hw.host_bw * assumptions.comm_efficiency)
    t_micro = max(t_compute, comm["zero3"]) + comm["exposed_sp"] + t_offload
    shard = _n_params(cfg) / lay.world
    if lay.offload_optimizer:
        per_gpu_bw = hw.host_mem_bw / hw.gpus_per_node * assumptions.cpu_adam_efficiency
        t_opt = shard * (CPU_ADAM_BYTES + prec.weight) / per_gpu_bw \
            + shard * (FP32_BYTES + prec.weight) / (hw.host_bw * assumptions.comm_efficiency)
    else:
        t_opt = shard * (2 * prec.optimizer + FP32_BYTES + prec.weight) / hw.hbm_bw
    step = lay.grad_accum * t_micro + t_opt
    batch = global_batch if global_batch is not None else lay.micro_batch * lay.grad_accum * lay.dp
    tps = batch * seq_len / step
    peak = hw.peak_flops * lay.world
    times = {"compute_per_micro": t_compute, "overlappable_comm_per_micro": comm["zero3"],
             "exposed_comm_per_micro": comm["exposed_sp"], "offload_per_micro": t_offload,
             "micro_step": t_micro, "dp_grad_comm": 0.0, "dp_param_allgather": 0.0, "dp_exposed": 0.0,
             "optimizer": t_opt, "optimizer_pcie": 0.0}
    return Prediction(layout=lay, memory=memory, fits=not limits, capacity=capacity, activation=act,
                      comm_mp={}, comm_dp={}, times=times, step_time=step, tokens_per_s=tps,
                      tokens_per_s_per_gpu=tps / lay.world, mfu=tps * flops["model"] / peak,
                      hfu=tps * flops["hardware"] / peak, exceeds=limits,
                      host_capacity=hw.host_memory_bytes)


def peer_layouts(cfg: ModelConfig, scheme: str, *, seq_len: int, world: int, global_batch: int | None = None,
                 max_degree: int = 64, offload_optimizer: tuple[bool, ...] = (False, True),
                 offload_block_inputs: tuple[bool, ...] = (False, True),
                 checkpointing: tuple[bool, ...] = (False, True), fields: dict | None = None) -> list[PeerLayout]:
    """Every layout of a peer `scheme` on `world` GPUs for one global batch: D a divisor of the
    world (at most max_degree) the shapes allow, DP = world / D dividing the batch (grad
    accumulation the rest, micro-batch 1; global_batch None: one sequence per replica), with and without checkpointing, each offload, each head
    chunk count (upipe: every count >= 2 that parallel.ulysses_head_chunks takes at D). `fields`: PeerLayout fields set on
    every layout (the ALST table's switches)."""
    out = []
    for d in (x for x in range(1, min(world, max_degree) + 1) if world % x == 0):
        dp = world // d
        batch = dp if global_batch is None else global_batch
        if batch % dp or peer_shapes_ok(cfg, scheme, d, seq_len):
            continue
        chunks = [1]
        if scheme == "upipe":           # the counts the trainer's parallel.ulysses_head_chunks takes
            chunks = [c for c in ulysses_head_chunk_counts(cfg, d) if c > 1]
        for c in chunks:
            for ac in checkpointing:
                for off_opt in offload_optimizer:
                    for off in offload_block_inputs:
                        if off and not ac:
                            continue
                        kw = {"activation_checkpointing": ac, "offload_optimizer": off_opt,
                              "offload_block_inputs": off, **(fields or {})}
                        out.append(PeerLayout(scheme, d, dp=dp, head_chunks=c,
                                              grad_accum=batch // dp, **kw))
    return out


def peer_longest(cfg: ModelConfig, scheme: str, *, hw: HardwareProfile, nodes: int, prec: Precision = BF16,
                 assumptions: Assumptions = Assumptions(), max_degree: int = 64, granule: int = 1024,
                 offload: bool = False, offload_optimizer: bool = False, fields: dict | None = None,
                 degrees: tuple[int, ...] | None = None):
    """The longest multiple of `granule` tokens some layout of a peer fits (one sequence per
    replica and step: with D < GPUs, ZeRO-3's DP replicas each hold a whole sequence),
    as plan/longest.py finds TSP's: `offload` the block inputs in host memory, `offload_optimizer`
    CPU Adam; `degrees`: only these D (the ALST table fixes D)."""
    from tsp_trainer.plan.longest import Longest, search_longest

    world = nodes * hw.gpus_per_node

    def predictions(seq_len: int) -> list[Prediction]:
        model = cfg.replace(max_seq_len=max(cfg.max_seq_len, seq_len))
        layouts = peer_layouts(model, scheme, seq_len=seq_len, world=world, max_degree=max_degree,
                               offload_optimizer=(offload_optimizer,), offload_block_inputs=(offload,),
                               checkpointing=(True,) if offload else (False, True), fields=fields)
        layouts = [lay for lay in layouts if degrees is None or lay.degree in degrees]
        return [predict_peer(model, lay, seq_len, hw, prec=prec, assumptions=assumptions)
                for lay in layouts]

    seq_len, best, bound = search_longest(predictions, granule)
    return Longest(scheme, seq_len, best, bound=bound)


def peer_ranking(cfg: ModelConfig, *, seq_len: int, global_batch: int, hw: HardwareProfile, nodes: int,
                 schemes: tuple[str, ...] = PEER_SCHEMES, prec: Precision = BF16,
                 assumptions: Assumptions = Assumptions(), max_degree: int = 64,
                 offload_optimizer: bool = False) -> dict[str, Prediction]:
    """Per peer scheme, the fastest layout that fits at seq_len (the ranking's order: step time,
    then memory); schemes with nothing that fits are left out."""
    world = nodes * hw.gpus_per_node
    model = cfg.replace(max_seq_len=max(cfg.max_seq_len, seq_len))
    out = {}
    for scheme in schemes:
        preds = [predict_peer(model, lay, seq_len, hw, global_batch=global_batch, prec=prec,
                              assumptions=assumptions)
                 for lay in peer_layouts(model, scheme, seq_len=seq_len, world=world,
                                         global_batch=global_batch, max_degree=max_degree,
                                         offload_optimizer=(offload_optimizer,))]
        fitting = [p for p in preds if p.fits]
        if fitting:
            out[scheme] = min(fitting, key=lambda p: (p.step_time, p.memory["total"]))
    return out


def format_beside_peers(trainer_best: dict[str, Prediction], peer_best: dict[str, Prediction],
                        peers: tuple[str, ...]) -> str:
    """TSP and the trainer's schemes beside the peers: the fastest fitting layout of each (tp_x_sp
    folded into one row), ranked by tokens/s; a peer with nothing that fits says so."""
    best: dict[str, Prediction] = {}
    for p in trainer_best.values():
        name = p.layout.scheme
        if p.fits and (name not in best or p.tokens_per_s > best[name].tokens_per_s):
            best[name] = p
    rows = sorted([*best.values(), *peer_best.values()], key=lambda p: -p.tokens_per_s)
    tsp = best.get("tsp")
    lines = [f"TSP beside the peers ({', '.join(peers)}: {PEER_STACK}s as the planner models them; the "
             "trainer runs them as " + "; ".join(f"{s}: {TRAINER_RUNS[s]}" for s in peers)
             + "): the fastest layout of each scheme that fits", "",
             "| # | scheme | tokens/s/GPU | MFU % | step s | GB/GPU | host GB/node | vs TSP | layout |",
             "|---|---|---|---|---|---|---|---|---|"]
    for i, p in enumerate(rows, 1):
        scheme = p.layout.scheme + (f" ({PEER_STACK})" if p.layout.scheme in PEER_SCHEMES else "")
        vs = f"{p.tokens_per_s / tsp.tokens_per_s:.2f}x" if tsp else "-"
        lines.append(f"| {i} | {scheme} | {p.tokens_per_s_per_gpu:,.0f} | {100 * p.mfu:.1f} | "
                     f"{p.step_time:.2f} | {p.memory['total'] / 1e9:.1f} | "
                     f"{p.memory['host_per_node'] / 1e9:,.0f} | {vs} | {p.layout.label()} |")
    lines += [f"| - | {s} ({PEER_STACK}) | nothing fits | | | | | | |" for s in peers if s not in peer_best]
    return "\n".join(lines)


@dataclass(frozen=True)
class AlstRow:
    """One row of ALST's published ablation (Llama-3.1-8B on one node of 8 x H100 80 GB with
    1.9 TB of host memory, arXiv 2506.13996 Table 1): its switches and the length ALST reached."""

    row: int
    configuration: str
    degree: int                     # Ulysses degree: 1 is ZeRO-3 DP over the 8 GPUs
    tiled_loss: bool
    tiled_mlp: bool
    offload_block_inputs: bool
    published: int                  # tokens


ALST_TABLE = (
    AlstRow(1, "ZeRO-3 + activation checkpointing + optimizer offload", 1, False, False, False, 32 * 1024),
    AlstRow(2, "row 1 + tiled logits/loss", 1, True, False, False, 160 * 1024),
    AlstRow(3, "row 2 + Ulysses SP 8", 8, True, False, False, 1_100_000),
    AlstRow(4, "row 3 + tiled MLP", 8, True, True, False, 1_200_000),
    AlstRow(5, "row 3 + block-input offload", 8, True, False, True, 2_400_000),
    AlstRow(6, "all of them", 8, True, True, True, 3_700_000),
)
ALST_HOST_MEMORY_GB = 1900
ALST_MODEL, ALST_GPU = "llama3_8b", "h100"


def alst_ablation(prec: Precision = BF16, assumptions: Assumptions = Assumptions(),
                  granule: int = 1024) -> list[tuple[AlstRow, object]]:
    """(row, the planner's Longest) for each row of ALST_TABLE: the ulysses layout (CPU Adam,
    activation checkpointing) with that row's switches at that row's degree."""
    from tsp_trainer.config.model import model_config
    from tsp_trainer.plan.hardware import get_profile

    cfg = model_config(ALST_MODEL)
    hw = get_profile(ALST_GPU, host_memory_gb=ALST_HOST_MEMORY_GB)
    out = []
    for r in ALST_TABLE:
        fields = {"tiled_loss": r.tiled_loss, "tiled_mlp": r.tiled_mlp}
        out.append((r, peer_longest(cfg, "ulysses", hw=hw, nodes=1, prec=prec, assumptions=assumptions,
                                    granule=granule, offload=r.offload_block_inputs, offload_optimizer=True,
                                    fields=fields, degrees=(r.degree,))))
    return out


def format_alst(rows) -> str:
    lines = [f"ALST's ablation ({ALST_MODEL} on 8 x {ALST_GPU}, {ALST_HOST_MEMORY_GB:,} GB host memory; "
             f"ulysses, {PEER_STACK}) beside the planner's longest length", "",
             "| row | configuration | ALST | planner | planner / ALST | peak phase | layout |",
             "|---|---|---|---|---|---|---|"]
    for r, longest in rows:
        best = longest.best
        lines.append(f"| {r.row} | {r.configuration} | {r.published:,} | {longest.seq_len:,} | "
                     f"{longest.seq_len / r.published - 1:+.1%} | "
                     f"{best.activation.peak_phase if best else '-'} | {best.layout.label() if best else '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """python -m tsp_trainer.plan.peers: ALST's published ablation beside the planner's rows."""
    import argparse

    argparse.ArgumentParser(prog="python -m tsp_trainer.plan.peers",
                            description="ALST's ablation table beside the planner's").parse_args(argv)
    print(format_alst(alst_ablation()))
    return 0


__all__ = ["ALST_TABLE", "PEER_SCHEMES", "AlstRow", "alst_ablation", "format_alst", "format_beside_peers", "PEER_STACK", "TRAINER_RUNS",
           "head_chunk_saving", "PeerLayout", "loss_chunk_tokens", "mlp_chunk_tokens",
           "peer_layouts", "peer_longest", "peer_memory", "peer_ranking", "peer_shapes_ok", "predict_peer"]


if __name__ == "__main__":
    raise SystemExit(main())
