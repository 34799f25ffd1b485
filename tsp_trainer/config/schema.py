"""The trainer's typed config: frozen dataclasses, standard library only.

`load.py` fills these from YAML (the only OmegaConf user); `validate.py` checks the rules. Every
builder receives only its own section, never the whole config. Each key is a `setting(...)`
(settings.py): its type here, its default, its one-line doc and its rule (bound or allowed values)
in one place, which the loader, the validator, the CLIs and `tsp-train --help-config` read. Choices
are `Literal[...]` types.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from tsp_trainer.config.model import MODEL_SIZES, ModelConfig
from tsp_trainer.config.model_source import resolve_model, resolve_tokenizer
from tsp_trainer.config.settings import setting

Scheme = Literal["tsp", "tp", "tp_sp", "sp", "tp_x_sp", "ulysses"]
TspRecompute = Literal["full", "selective", "none"]
# "auto": the planner's memory model chooses the value at start-up (plan/auto.py)
Auto = Literal["auto"]
TspRecomputeSetting = Literal["auto", TspRecompute]
ReplayKeeps = Literal["all", "attention", "nothing"]
ReplayKeepsSetting = Literal["auto", ReplayKeeps]
DataFormat = Literal["auto", "jsonl", "parquet", "text", "arrow", "tokens", "hub"]
LayoutChange = Literal["refuse", "restart"]
DType = Literal["auto", "fp32", "bf16"]
AttentionKernel = Literal["auto", "fa2", "fa3", "fa4", "cudnn"]
AttentionGqa = Literal["auto", "native", "fused"]
NonFinite = Literal["skip", "stop"]
OffloadOptimizer = Literal["none", "cpu"]
WandbMode = Literal["disabled", "offline", "online"]
WandbReplay = Literal["skip", "rewind"]
ResumeChange = Literal["recipe", "checkpoint"]
RopeType = Literal["default", "linear", "llama3", "yarn"]
Family = Literal["llama", "mistral", "qwen2", "qwen3"]

ZERO_STAGES = (0, 1, 2, 3)
# Schemes whose ranks of one axis hold the same weights: ZeRO-3 shards them over the axis x dp.
SHARDED_WEIGHT_SCHEMES = ("sp", "ulysses")
# Signals a preemption may arrive with; SIGKILL and SIGSTOP cannot be caught, SIGINT stays Ctrl-C.
PREEMPT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGXCPU")


def resolved_zero_stage(stage: int | str, scheme: str) -> int:
    """zero.stage, "auto" resolved: 3 where the axis' ranks hold the same weights (sp, ulysses:
    ZeRO-3 shards them over the axis x dp), 1 elsewhere (the axis shards the weights itself)."""
    if stage != "auto":
        return stage
    return 3 if scheme in SHARDED_WEIGHT_SCHEMES else 1


def resolved_dtype(dtype: str, cuda: bool) -> str:
    """"bf16" or "fp32": what train.dtype (or tsp-bench --dtype) means on this device; "auto"
    is bf16 on GPUs and fp32 on CPUs (bf16 matmuls are slow and imprecise there)."""
    return ("bf16" if cuda else "fp32") if dtype == "auto" else dtype


@dataclass(frozen=True)
class RopeScalingSection:
    """Transformers' rope_parameters keys. Unset (all null) keeps the size's or
    folder's scaling; any key set replaces it and needs rope_type (docs/long_context/rope.md)."""

    rope_type: RopeType | None = setting(None, doc="default (no scaling), linear, llama3 or yarn")
    factor: float | None = setting(None, doc="context extension ratio (new / original context)")
    original_max_position_embeddings: int | None = setting(
        None, doc="llama3, yarn: the pretraining context")
    low_freq_factor: float | None = setting(None, doc="llama3 (Llama 3.1: 1)")
    high_freq_factor: float | None = setting(None, doc="llama3 (Llama 3.1: 4)")
    attention_factor: float | None = setting(None, doc="yarn: cos/sin scale (default 0.1 ln(factor) + 1)")
    beta_fast: float | None = setting(None, doc="yarn: default 32")
    beta_slow: float | None = setting(None, doc="yarn: default 1")
    mscale: float | None = setting(None, doc="yarn, DeepSeek-style attention_factor")
    mscale_all_dim: float | None = setting(None, doc="yarn")
    truncate: bool | None = setting(None, doc="yarn: round the correction range to integers (default true)")


@dataclass(frozen=True)
class ModelSection:
    """A named size or a Hugging Face folder, plus optional overrides; null means "not set": take
    the value from the size or the folder (config/model_source.py states the rule)."""

    size: str | None = setting(None, choices=tuple(MODEL_SIZES),
                               doc="a named size; null: tiny, or the folder's shape")
    vocab_size: int | None = setting(None, doc="tokens in the embedding / LM head")
    hidden_size: int | None = setting(None, doc="h, the residual width")
    num_layers: int | None = setting(None, doc="decoder blocks")
    num_heads: int | None = setting(None, doc="query heads")
    num_kv_heads: int | None = setting(None, doc="K/V heads (GQA when < num_heads)")
    head_dim: int | None = setting(None, doc="channels per head; null: hidden_size / num_heads")
    intermediate_size: int | None = setting(None, doc="gated-MLP width I")
    max_seq_len: int | None = setting(None, doc="longest sequence RoPE is set up for (tokens)")
    # The three floats are checked on the resolved model (the size's or folder's value, or this).
    rope_theta: float | None = setting(None, above=0, doc="RoPE base")
    rope_scaling: RopeScalingSection = field(default_factory=RopeScalingSection)
    norm_eps: float | None = setting(None, above=0, doc="RMSNorm epsilon")
    tie_embeddings: bool | None = setting(None, doc="share the embedding and LM-head matrix")
    family: Family | None = setting(None, doc="the Hugging Face model_type export writes")
    qkv_bias: bool | None = setting(None, doc="q/k/v_proj biases (Qwen2; Llama attention_bias)")
    o_bias: bool | None = setting(None, doc="o_proj bias (Llama attention_bias)")
    mlp_bias: bool | None = setting(None, doc="gate/up/down_proj biases (Llama mlp_bias)")
    qk_norm: bool | None = setting(None, doc="RMSNorm over each q and k head before RoPE (Qwen3)")
    # N(0, 1) is the widest init in use (unit-variance embeddings); the LM head's logits have std
    # ~ init_std * sqrt(hidden_size) on RMS-normalised inputs, so beyond it the softmax saturates
    # (and 1e30 overflows to inf), and the loss stays at ln(vocab_size) with nothing to learn from.
    init_std: float | None = setting(None, above=0, below=1, doc="std of the normal weight init",
                                     note="wider saturates the softmax: logits' std is about "
                                          "init_std x sqrt(hidden_size)")
    init_from: str | None = setting(None, doc="Hugging Face folder to start from: shape + weights")
    config_from: str | None = setting(None, doc="Hugging Face folder or config.json: shape only")
    seed: int = setting(0, min=0, doc="RNG seed for the weight init")

    def to_model_config(self) -> ModelConfig:
        """Named size or folder + the keys set here (reads the folder's config.json)."""
        return resolve_model(self)


@dataclass(frozen=True)
class ParallelSection:
    """The model-parallel axis (size D = tsp_degree for every scheme) and the DP axis around it."""

    scheme: Scheme = setting("tsp", doc="TSP, or one of the baselines it is compared with (Megatron "
                                        "TP, TP + SP, context parallelism, T x S on two sub-axes, "
                                        "DeepSpeed-Ulysses all-to-all sequence parallelism with "
                                        "replicated weights)")
    tsp_degree: int = setting(1, min=1, doc="D: ranks of one model-parallel group, inner mesh axis")
    head_buckets: int | Auto = setting("auto", min=1, doc="TSP: K/V all-gathers per weight shard (bounds the "
                                                     "K/V buffer); auto = chosen at start-up with "
                                                     "tsp_recompute")
    tsp_recompute: TspRecomputeSetting = setting(
        "auto", doc="TSP backward: full recomputes projections + attention and the MLP's gate/up "
                    "from X_p; selective keeps q, k/v, attention outputs (~5 X_p more per layer) and "
                    "skips the attention recompute; none also keeps the MLP's gate/up "
                    "pre-activations (+2 B S/D I elements per layer): backward re-runs no forward GEMM; "
                    "auto = the fastest of these, checkpointing and head buckets whose predicted "
                    "peak fits train.memory_budget_gib (docs/planner.md)")
    checkpoint_replay_keeps: ReplayKeepsSetting = setting(
        "auto", doc="TSP under train.activation_checkpointing (no effect without it): what a "
                    "block's replay keeps for its backward; all = the attention items and the MLP's "
                    "gate/up (no forward runs a third time); attention = the items only, the MLP's "
                    "backward recomputes gate/up per token chunk; nothing = neither, attention also "
                    "runs its forward again in backward; auto = all where it fits the memory budget, "
                    "else the leaner value that does (docs/long_context/longest_context.md)")
    loss_chunk_tokens: int | Literal["auto"] = setting(
        "auto", min=1, doc="local tokens the LM head's loss takes at a time (fp32 logits [chunk, "
                           "V/D]); auto: all at once unless that block exceeds 1 GiB, else the "
                           "fewest equal chunks under it (docs/long_context/tiled_loss.md)")
    mlp_chunk_tokens: int | Literal["auto"] = setting(
        "auto", min=1, doc="local tokens the gated MLP takes at a time within each ring step / "
                           "local matmul (intermediates [chunk, I/D]); auto: all at once unless "
                           "the ~6 alive [tokens, I/D] intermediates exceed 1 GiB, else the fewest "
                           "equal chunks under it; once tiled, a TSP layer's [N/D, h] accumulators "
                           "are kept in the activation dtype (docs/long_context/tiled_mlp.md)")
    ulysses_head_chunks: int | Auto = setting(
        "auto", min=1, doc="ulysses: groups of heads the attention runs one at a time after the "
                           "all-to-all (UPipe; each chunk's own all-to-alls, its full-sequence "
                           "q/k/v/o the only ones alive; backward replays a chunk's forward); "
                           "num_heads / (chunks x D) whole; auto = 1 unless the predicted peak "
                           "needs more to fit train.memory_budget_gib, then the fewest that fit "
                           "(docs/parallelism.md); other schemes and D = 1: 1")
    attention_chunk_tokens: int | Literal["auto"] = setting(
        "auto", min=1, doc="TSP: local tokens of every rank in each K/V chunk of attention; an item "
                           "gathers its K/V, and reduce-scatters its dK/dV, chunk by chunk, merged "
                           "by log-sum-exp, never the whole sequence's; auto: one chunk (the "
                           "unchunked path) unless an item's gathered K/V exceeds 1 GiB, else the "
                           "fewest equal chunks under it; with K/V heads fewer "
                           "than D (copies) every item gathers whole (docs/parallelism.md)")
    tp_degree: int | None = setting(None, min=1, doc="tp_x_sp only: T, with T x S = D")
    sp_degree: int | None = setting(None, min=1, doc="tp_x_sp only: S, with T x S = D")
    dp_degree: int | None = setting(None, min=1, doc="null = world_size // tsp_degree; if set, must match")


@dataclass(frozen=True)
class SourceSection:
    """One source of a token-weighted mixture (`data.sources`); unset fields follow `data.*`."""

    source: str = setting("???", doc="local file/folder/glob or a hub dataset name")
    weight: float = setting(1.0, above=0, doc="share of the trained tokens (normalised over sources)")
    name: str | None = setting(None, doc="label in logs and metrics; null = the source")
    format: DataFormat = setting("auto", doc="as data.format")
    text_field: str | None = setting(None, doc="null = data.text_field")
    token_field: str | None = setting(None, doc="null = data.token_field")
    split: str | None = setting(None, doc="null = data.train_split")


@dataclass(frozen=True)
class LengthStageSection:
    """One stage of `data.seq_len_schedule`: from optimizer step `start_step` (0-based) on."""

    start_step: int = setting(0, doc="first optimizer step of the stage (0-based)")
    seq_len: int = setting(256, min=1, doc="tokens per sequence in this stage")
    micro_batch_size: int | None = setting(None, min=1, doc="null = data.micro_batch_size")


@dataclass(frozen=True)
class UpsampleSection:
    """Repeat long documents (a long-context control); off while min_tokens is 0."""

    min_tokens: int = setting(0, min=0, doc="documents with at least this many tokens are upsampled; "
                                            "0 = off")
    factor: float = setting(1.0, min=1, note="1 = no upsampling",
                            doc="times each long document is trained on, on average")
    gap_docs: int = setting(16, min=1, doc="documents between a long document and its next copy")


@dataclass(frozen=True)
class DataSection:
    """Where tokens come from and how they are batched (sequences, not tokens, per micro-batch)."""

    source: str | None = setting("data/corpus", doc="local file/folder/glob or a hub name; null with "
                                                    "data.sources")
    sources: list[SourceSection] = setting(factory=list, doc="a mixture weighted by tokens")
    format: DataFormat = setting("auto", doc="auto = from the file suffix; hub = a hub name; else checked")
    text_field: str = setting("text", doc="column holding the raw text")
    token_field: str | None = setting(None, doc="column of token ids (pre-tokenized data); null = text")
    train_split: str = setting("train", doc="split of the source to train on")
    eval_split: str | None = setting("validation", doc="split to evaluate on; null = no evaluation data")
    eval_source: str | None = setting(None, doc="held-out data; null = data.source's eval_split")
    eval_replicate: bool = setting(True, doc="fewer eval documents than DP ranks: all ranks read all")
    tokenizer: str | None = setting(None, doc="folder or hub name; null: the model folder's, else "
                                              "data/tokenizer")
    seq_len: int = setting(256, min=1, doc="tokens per packed sequence (the whole sequence, not a "
                                           "rank's zigzag share)")
    seq_len_schedule: list[LengthStageSection] = setting(factory=list, doc="short -> long sequences "
                                                                           "by step")
    micro_batch_size: int = setting(2, min=1, doc="sequences per DP rank per forward/backward")
    shuffle: bool = setting(False, doc="buffered shuffle of the stream")
    shuffle_buffer: int = setting(1000, min=1, doc="examples held by the shuffle buffer")
    prefetch: int = setting(2, min=0, doc="micro-batches a worker thread prepares ahead; 0 = off")
    upsample: UpsampleSection = field(default_factory=UpsampleSection)
    mixture_estimate_docs: int = setting(64, min=1, doc="documents read per source to estimate its "
                                                        "mean length")
    max_example_split_dp: int = setting(8, min=1, doc="above this DP degree, refuse sources with "
                                                      "fewer shards than DP ranks")
    dataset_tokens: int | None = setting(None, min=1, doc="tokens in one epoch of the train data, "
                                                          "if known")
    max_epochs_warning: float = setting(1.0, above=0, doc="warn at start-up when the run reads its "
                                                          "data more often than this")
    on_layout_change: LayoutChange = setting("refuse", doc="resuming loader state under another DP "
                                                           "degree: refuse, or restart the data")
    document_masking: bool = setting(False, doc="no token attends across a document boundary (EOS)")
    reset_positions: bool = setting(False, doc="with document_masking: RoPE positions restart per "
                                               "document")


@dataclass(frozen=True)
class OptimSection:
    """AdamW with linear warmup then cosine decay from lr to min_lr."""

    # AdamW moves every weight by about lr per step whatever the gradient's scale, so a rate of
    # 1 or more throws the weights away at the first step (1e39 overflows them to inf).
    lr: float = setting(3e-4, above=0, below=1, doc="peak learning rate",
                        note="AdamW moves each weight by about lr per step")
    min_lr: float = setting(3e-5, min=0, doc="learning rate at the last step")
    warmup_steps: int = setting(10, min=0, doc="optimizer steps of linear warmup")
    # AdamW multiplies each decayed weight by (1 - lr * weight_decay) per step: at lr * weight_decay
    # >= 1 that factor is 0 or negative (validate.py), and 1e30 overflows the weights at once.
    weight_decay: float = setting(0.1, min=0, doc="AdamW decoupled weight decay; lr * weight_decay "
                                                  "must be below 1")
    beta1: float = setting(0.9, min=0, below=1, doc="AdamW first-moment decay")
    beta2: float = setting(0.95, min=0, below=1, doc="AdamW second-moment decay")
    eps: float = setting(1e-8, above=0, doc="AdamW denominator epsilon")
    max_grad_norm: float = setting(1.0, min=0, note="0 = no clipping", doc="global L2 clip")
    on_resume_change: ResumeChange | None = setting(
        None, doc="a resume whose lr, min_lr, warmup_steps, train.steps, betas or weight_decay differ "
                  "from the checkpoint's: recipe = the recipe's schedule and settings from the "
                  "resumed step, checkpoint = the saved ones; unset = refuse (docs/checkpoints.md)")


@dataclass(frozen=True)
class ZeroSection:
    """DeepSpeed ZeRO: stages 0-2 over the DP axis; stage 3 (schemes sp and ulysses) over every rank."""

    stage: int | Auto = setting("auto", choices=ZERO_STAGES,
                                doc="DeepSpeed ZeRO stage; auto = 3 for sp and ulysses (weights, gradients "
                                    "and optimizer state sharded over the axis x dp), 1 for the others "
                                    "(optimizer state sharded over dp); 3 only for sp and ulysses")
    offload_optimizer: OffloadOptimizer = setting(
        "none", doc="cpu: DeepSpeed's ZeRO-Offload keeps the fp32 master weights, AdamW moments and "
                    "the fp32 gradient partition in pinned host memory and runs the update with "
                    "DeepSpeedCPUAdam; needs zero.stage 1, 2 or 3 (3: sp and ulysses, whose fp32 "
                    "gradient partition goes to the host too; docs/long_context/optimizer_offload.md)")


@dataclass(frozen=True)
class TrainSection:
    """The loop: how long, in what precision, where to write, how to recover."""

    steps: int = setting(100, min=1, doc="optimizer steps")
    grad_accum: int = setting(1, min=1, doc="micro-batches per optimizer step")
    global_batch_size: int | None = setting(None, min=1, doc="sequences per step; if set, must be "
                                                             "micro x grad_accum x dp")
    dtype: DType = setting("auto", doc="auto = bf16 on GPU, fp32 on CPU")
    attention_kernel: AttentionKernel = setting(
        "auto", doc="CUDA attention: auto = the first of fa3, fa4, fa2 installed that takes the run; "
                    "CPU runs take auto only (docs/trainer.md)")
    attention_gqa: AttentionGqa = setting(
        "auto", doc="CUDA flash attention under GQA: fused = SDPA's one call (faster; its backward "
                    "holds dK/dV per query head), native = one call per group member with the KV "
                    "heads (no tensor per query head; slower at short lengths); auto = the faster "
                    "that fits the planned memory: fused up to about 1M tokens, native where memory "
                    "needs it or it is no slower (docs/trainer.md)")
    activation_checkpointing: bool | Auto = setting("auto", doc="recompute each block in backward; auto = "
                                                                "only when nothing faster fits")
    checkpoint_segment_blocks: int | Auto = setting(
        1, min=1, doc="nested checkpointing: keep only every k-th block input, re-running each "
                      "segment of k blocks forward in backward (needs activation checkpointing); "
                      "1 = per-block checkpointing; auto = the smallest k that fits the budget "
                      "(docs/long_context/longest_context.md)")
    memory_budget_gib: float | None = setting(
        None, above=0, doc="memory per process the auto settings must fit (GiB); null = the GPU's "
                           "memory less the planner's reserve, on CPU available host memory / processes")
    offload_activations: bool | Auto = setting(
        False, doc="blocks' saved tensors to host memory (model/offload.py); auto = only when "
                   "nothing fits the memory budget without it or nesting, then where the node's "
                   "host memory holds the pinned copies and the planner predicts it faster than "
                   "nesting (docs/long_context/longest_context.md)")
    offload_prefetch: bool | Auto = setting(
        "auto", doc="with train.offload_activations: a block's backward fetches the next block's "
                    "saved tensors from the host ahead (two blocks' on the device, the copies hidden); "
                    "false fetches each block's when its backward asks (one block's, the copies "
                    "exposed); auto = true unless only false fits the memory budget "
                    "(docs/long_context/longest_context.md)")
    eval_every: int = setting(0, min=0, doc="optimizer steps between evaluations; 0 = off")
    eval_batches: int = setting(4, min=1, doc="micro-batches per evaluation")
    seed: int = setting(0, min=0, doc="RNG seed for data order and per-rank streams")
    output_dir: str = setting("runs/default", doc="run folder: config.yaml, checkpoints, metrics")
    resume: str = setting("none", doc="none, auto (latest in output_dir), a checkpoint or a run folder")
    overwrite_output_dir: bool = setting(False, doc="with resume=none: delete an earlier run's "
                                                    "checkpoints and metrics")
    nonfinite: NonFinite = setting("skip", doc="on a NaN/inf loss or grad norm: skip the step or stop")
    max_consecutive_skips: int = setting(10, min=1, doc="nonfinite=skip: stop with an error after this "
                                                        "many skips in a row")
    collective_timeout_s: int = setting(600, min=1, doc="timeout of every process group (seconds)")
    hang_dump_s: float | None = setting(None, min=0, note="0 = no hang dumps, null = half the "
                                                          "collective timeout",
                                        doc="a step running longer (seconds) dumps stacks + ops in flight")
    nccl_blocking_wait: bool = setting(False, doc="NCCL: TORCH_NCCL_BLOCKING_WAIT=1, a stalled peer "
                                                  "raises CommError")
    preempt_signals: list[str] = setting(factory=lambda: ["SIGTERM", "SIGUSR1"], choices=PREEMPT_SIGNALS,
                                         doc="signals on which the run checkpoints, then exits 75; "
                                             "[] = none (Ctrl-C, SIGINT, always checkpoints, then "
                                             "exits 130)")
    max_runtime_min: float = setting(0.0, min=0, note="0 = no limit",
                                     doc="checkpoint and exit 75 before this many minutes")


@dataclass(frozen=True)
class EvalSection:
    """Long-context evaluation under the training layout (docs/long_context/evaluation.md).
    The eval loss itself runs every train.eval_every steps on train.eval_batches micro-batches."""

    loss_by_position: bool = setting(True, doc="also report that eval loss per position bucket "
                                               "(1, 2, 4, ... seq_len)")
    passkey_every: int = setting(0, min=0, doc="optimizer steps between passkey retrieval runs; 0 = off")
    passkey_lengths: list[int] = setting(factory=list, doc="haystack lengths in tokens; [] = "
                                                           "[data.seq_len]")
    passkey_depths: list[float] = setting(factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0],
                                          doc="needle depths in [0, 1]: 0 = start, 1 = end")
    passkey_samples: int = setting(4, min=1, doc="haystacks per (length, depth), spread over the DP ranks")
    passkey_digits: int = setting(5, min=1, doc="digits of the hidden number")
    passkey_filler: str | None = setting(None, doc="text source of the haystack; null = data.source")
    passkey_filler_split: str | None = setting(None, doc="its split; null = data.eval_split (else "
                                                         "data.train_split)")
    passkey_seed: int = setting(0, min=0, doc="keys and filler offsets (the same haystacks at every run)")


@dataclass(frozen=True)
class CheckpointSection:
    """When checkpoints are written and how many are kept."""

    every: int = setting(0, min=0, doc="optimizer steps between checkpoints; 0 = only at the end")
    keep_last: int = setting(3, min=1, doc="complete checkpoints kept on disk")
    enabled: bool = setting(True, doc="write checkpoints at all")
    async_save: bool = setting(False, doc="write in a background thread; publish when complete")
    pinned_staging: bool = setting(True, doc="async_save on a GPU: stage in pinned host memory "
                                             "(false = pageable: no page-locked RAM, slower copies)")


@dataclass(frozen=True)
class LoggingSection:
    """Metrics: W&B, metrics.jsonl, the progress bar."""

    wandb_mode: WandbMode = setting("disabled", doc="W&B: off, offline (sync later) or online")
    wandb_project: str = setting("tsp_trainer", doc="W&B project")
    wandb_entity: str | None = setting(None, doc="W&B team or user; null = the login's default")
    wandb_group: str | None = setting(None, doc="groups related runs (e.g. a sweep) in the W&B UI")
    wandb_tags: list[str] = setting(factory=list, doc="W&B tags of the run")
    wandb_replay: WandbReplay = setting("skip", doc="steps replayed after a resume: skip them or "
                                                    "rewind the run")
    run_name: str | None = setting(None, doc="null = derived from output_dir")
    log_every: int = setting(1, min=1, doc="optimizer steps between metric lines")
    progress_bar: bool = setting(True, doc="a progress bar on rank 0")
    jsonl: bool = setting(True, doc="metrics.jsonl in output_dir")
    peak_tflops: float | None = setting(None, above=0, note="null = detect it on a known GPU",
                                        doc="one device's peak TFLOP/s, for MFU")
    rank_stats_every: int = setting(10, min=0, doc="steps between gathers of every rank's step time; "
                                                   "0 = off")


@dataclass(frozen=True)
class TrainConfig:
    """The root config. Only the Trainer, checkpoints (the resolved config they carry) and observability see all of it."""

    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    zero: ZeroSection = field(default_factory=ZeroSection)
    train: TrainSection = field(default_factory=TrainSection)
    eval: EvalSection = field(default_factory=EvalSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def tokenizer_source(self) -> str:
        """data.tokenizer, else the model folder's tokenizer, else the bundled one (model_source.py)."""
        return resolve_tokenizer(self.data.tokenizer, self.model)
