"""The trainer's typed config: frozen dataclasses, standard library only.

`load.py` fills these from YAML (the only OmegaConf user); `validate.py` checks the cross-field
rules. Every builder receives only its own section (STYLE.md section 4). Choices are `Literal[...]`
so that the loader and the validator read the allowed values from one place.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from tsp_trainer.config.model import ModelConfig
from tsp_trainer.config.model_source import resolve_model, resolve_tokenizer

Scheme = Literal["tsp", "tp", "tp_sp", "sp", "tp_x_sp"]
TspRecompute = Literal["full", "selective", "none"]
DataFormat = Literal["auto", "jsonl", "parquet", "text", "arrow", "tokens", "hub"]
LayoutChange = Literal["refuse", "restart"]
DType = Literal["auto", "fp32", "bf16"]


def resolved_dtype(dtype: str, cuda: bool) -> str:
    """"bf16" or "fp32": what train.dtype (or tsp-bench --dtype) means on this device; "auto"
    is bf16 on GPUs and fp32 on CPUs (bf16 matmuls are slow and imprecise there)."""
    return ("bf16" if cuda else "fp32") if dtype == "auto" else dtype


NonFinite = Literal["skip", "stop"]
WandbMode = Literal["disabled", "offline", "online"]
WandbReplay = Literal["skip", "rewind"]
RopeType = Literal["default", "linear", "llama3", "yarn"]
Family = Literal["llama", "mistral", "qwen2"]


@dataclass(frozen=True)
class RopeScalingSection:
    """model.rope_scaling: transformers' rope_parameters keys. Unset (all null) keeps the size's or
    folder's scaling; any key set replaces it and needs rope_type (docs/long_context.md)."""

    rope_type: RopeType | None = None          # default (no scaling) | linear | llama3 | yarn
    factor: float | None = None                # context extension ratio (new / original context)
    original_max_position_embeddings: int | None = None   # llama3, yarn: the pretraining context
    low_freq_factor: float | None = None       # llama3 (Llama 3.1: 1)
    high_freq_factor: float | None = None      # llama3 (Llama 3.1: 4)
    attention_factor: float | None = None      # yarn: cos/sin scale (default 0.1 ln(factor) + 1)
    beta_fast: float | None = None             # yarn: default 32
    beta_slow: float | None = None             # yarn: default 1
    mscale: float | None = None                # yarn, DeepSeek-style attention_factor
    mscale_all_dim: float | None = None        # yarn
    truncate: bool | None = None               # yarn: default true


@dataclass(frozen=True)
class ModelSection:
    """A named size or a Hugging Face folder, plus optional overrides; None means "not set": take
    the value from the size or the folder (config/model_source.py states the rule)."""

    size: str | None = None                    # a key of config.model.MODEL_SIZES (null: "tiny", or the folder)
    vocab_size: int | None = None              # tokens in the embedding / LM head
    hidden_size: int | None = None             # h, the residual width
    num_layers: int | None = None              # decoder blocks
    num_heads: int | None = None               # query heads
    num_kv_heads: int | None = None            # K/V heads (GQA when < num_heads)
    intermediate_size: int | None = None       # gated-MLP width I
    max_seq_len: int | None = None             # longest sequence RoPE is set up for (tokens)
    rope_theta: float | None = None            # RoPE base
    rope_scaling: RopeScalingSection = field(default_factory=RopeScalingSection)
    norm_eps: float | None = None              # RMSNorm epsilon
    tie_embeddings: bool | None = None         # share the embedding and LM-head matrix
    family: Family | None = None               # Hugging Face model_type export writes
    qkv_bias: bool | None = None               # q/k/v_proj biases (Qwen2; Llama attention_bias)
    o_bias: bool | None = None                 # o_proj bias (Llama attention_bias)
    mlp_bias: bool | None = None               # gate/up/down_proj biases (Llama mlp_bias)
    init_std: float | None = None              # std of the normal weight init
    init_from: str | None = None               # Hugging Face folder to start from: shape + weights
    config_from: str | None = None             # Hugging Face folder or config.json: shape only
    seed: int = 0                              # RNG seed for the weight init

    def to_model_config(self) -> ModelConfig:
        """Named size or folder + the keys set here (reads the folder's config.json)."""
        return resolve_model(self)


@dataclass(frozen=True)
class ParallelSection:
    """The model-parallel axis (size D = tsp_degree for every scheme) and the DP axis around it."""

    scheme: Scheme = "tsp"                     # TSP or one of the baselines (DESIGN.md section 4)
    tsp_degree: int = 1                        # D: ranks of one model-parallel group, inner mesh axis
    head_buckets: int = 1                      # TSP: K/V all-gathers per weight shard (bounds the K/V buffer)
    tsp_recompute: TspRecompute = "full"       # TSP backward: "full" recomputes projections + attention
                                               # and the MLP's gate/up from X_p; "selective" keeps q,
                                               # k/v, attention outputs (~5 X_p more per layer) and
                                               # skips the attention recompute; "none" also keeps the
                                               # MLP's gate/up pre-activations (+2 B S/D I elements
                                               # per layer): backward re-runs no forward GEMM
    tp_degree: int | None = None               # tp_x_sp only: T, with T x S = D
    sp_degree: int | None = None               # tp_x_sp only: S, with T x S = D
    dp_degree: int | None = None               # None = world_size // tsp_degree; if set, must match


@dataclass(frozen=True)
class SourceSection:
    """One source of a token-weighted mixture (`data.sources`); unset fields follow `data.*`."""

    source: str = "???"                        # local file/folder/glob or a hub dataset name
    weight: float = 1.0                        # share of the trained tokens (normalised over sources)
    name: str | None = None                    # label in logs and metrics; None = the source
    format: DataFormat = "auto"
    text_field: str | None = None              # None = data.text_field
    token_field: str | None = None             # None = data.token_field
    split: str | None = None                   # None = data.train_split


@dataclass(frozen=True)
class LengthStageSection:
    """One stage of `data.seq_len_schedule`: from optimizer step `start_step` (0-based) on."""

    start_step: int = 0
    seq_len: int = 256                         # tokens per sequence in this stage
    micro_batch_size: int | None = None        # None = data.micro_batch_size


@dataclass(frozen=True)
class UpsampleSection:
    """Repeat long documents (a long-context control); off while min_tokens is 0."""

    min_tokens: int = 0                        # documents with at least this many tokens are upsampled
    factor: float = 1.0                        # times each long document is trained on, on average
    gap_docs: int = 16                         # documents between a long document and its next copy


@dataclass(frozen=True)
class DataSection:
    """Where tokens come from and how they are batched (sequences, not tokens, per micro-batch)."""

    source: str | None = "data/corpus"         # local file/folder/glob or a hub name; null with data.sources
    sources: list[SourceSection] = field(default_factory=list)   # a mixture weighted by tokens
    format: DataFormat = "auto"                # "auto" = from the file suffix; "hub" = hub name; else checked
    text_field: str = "text"                   # column holding the raw text
    token_field: str | None = None             # column of token ids (pre-tokenized data); None = text
    train_split: str = "train"
    eval_split: str | None = "validation"      # None = no evaluation data
    eval_source: str | None = None             # held-out data; None = data.source's eval_split
    eval_replicate: bool = True                # fewer eval documents than DP ranks: all ranks read all
    tokenizer: str | None = None               # folder or hub name; null: the model folder's, else data/tokenizer
    seq_len: int = 256                         # tokens per packed sequence (before the zigzag split)
    seq_len_schedule: list[LengthStageSection] = field(default_factory=list)  # short -> long by step
    micro_batch_size: int = 2                  # sequences per DP rank per forward/backward
    shuffle: bool = False                      # buffered shuffle of the stream
    shuffle_buffer: int = 1000                 # examples held by the shuffle buffer
    prefetch: int = 2                          # micro-batches a worker thread prepares ahead; 0 = off
    upsample: UpsampleSection = field(default_factory=UpsampleSection)
    mixture_estimate_docs: int = 64            # documents read per source to estimate its mean length
    max_example_split_dp: int = 8              # above this DP degree, refuse sources with < dp shards
    dataset_tokens: int | None = None          # tokens in one epoch of the train data, if known
    max_epochs_warning: float = 1.0            # warn at start-up when the run reads its data more often
    on_layout_change: LayoutChange = "refuse"  # resuming loader state under another DP degree
    document_masking: bool = False             # no token attends across a document boundary (EOS)
    reset_positions: bool = False              # with document_masking: RoPE positions restart per document


@dataclass(frozen=True)
class OptimSection:
    """AdamW with linear warmup then cosine decay from lr to min_lr."""

    lr: float = 3e-4                           # peak learning rate
    min_lr: float = 3e-5                       # learning rate at the last step
    warmup_steps: int = 10                     # optimizer steps of linear warmup
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    max_grad_norm: float = 1.0                 # global L2 clip; 0 = no clipping


@dataclass(frozen=True)
class ZeroSection:
    """DeepSpeed ZeRO over the DP axis only."""

    stage: int = 1                             # 0, 1 or 2; 3 is not yet proven with TSP (DESIGN.md section 7)


@dataclass(frozen=True)
class TrainSection:
    """The loop: how long, in what precision, where to write, how to recover."""

    steps: int = 100                           # optimizer steps
    grad_accum: int = 1                        # micro-batches per optimizer step
    global_batch_size: int | None = None       # sequences per step; if set, must be micro x grad_accum x dp
    dtype: DType = "auto"                      # "auto" = bf16 on GPU, fp32 on CPU
    activation_checkpointing: bool = False     # recompute each block in backward
    offload_activations: bool = False          # blocks' saved tensors to host memory (model/offload.py)
    eval_every: int = 0                        # optimizer steps between evaluations; 0 = off
    eval_batches: int = 4                      # micro-batches per evaluation
    seed: int = 0                              # RNG seed for data order and per-rank streams
    output_dir: str = "runs/default"           # run folder: config.yaml, checkpoints, metrics
    resume: str = "none"                       # "none", "auto" (latest in output_dir), a checkpoint or a run folder
    overwrite_output_dir: bool = False         # with resume=none: delete an earlier run's checkpoints and metrics
    nonfinite: NonFinite = "skip"              # on a NaN/inf loss or grad norm: skip the step or stop
    max_consecutive_skips: int = 10            # nonfinite=skip: stop with an error after this many skips in a row
    collective_timeout_s: int = 600            # timeout of every process group (seconds)
    hang_dump_s: float | None = None           # a step running longer dumps stacks + ops in flight;
                                               # None = half of collective_timeout_s, 0 = off
    nccl_blocking_wait: bool = False           # NCCL: TORCH_NCCL_BLOCKING_WAIT=1, a stalled peer raises CommError
    preempt_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])  # checkpoint, then exit 75
    max_runtime_min: float = 0.0               # checkpoint and exit 75 before this many minutes; 0 = no limit


@dataclass(frozen=True)
class EvalSection:
    """Long-context evaluation under the training layout (docs/long_context.md, "Evaluation").
    The eval loss itself runs every train.eval_every steps on train.eval_batches micro-batches."""

    loss_by_position: bool = True              # also report that eval loss per position bucket (1, 2, 4, ... seq_len)
    passkey_every: int = 0                     # optimizer steps between passkey retrieval runs; 0 = off
    passkey_lengths: list[int] = field(default_factory=list)   # haystack lengths in tokens; [] = [data.seq_len]
    passkey_depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])  # needle depth, 0 = start, 1 = end
    passkey_samples: int = 4                   # haystacks per (length, depth), spread over the DP ranks
    passkey_digits: int = 5                    # digits of the hidden number
    passkey_filler: str | None = None          # text source of the haystack; null = data.source
    passkey_filler_split: str | None = None    # its split; null = data.eval_split (else data.train_split)
    passkey_seed: int = 0                      # keys and filler offsets (the same haystacks at every run)


@dataclass(frozen=True)
class CheckpointSection:
    every: int = 0                             # optimizer steps between checkpoints; 0 = only at the end
    keep_last: int = 3                         # complete checkpoints kept on disk
    enabled: bool = True
    async_save: bool = False                   # write in a background thread; publish when complete


@dataclass(frozen=True)
class LoggingSection:
    wandb_mode: WandbMode = "disabled"
    wandb_project: str = "tsp_trainer"
    wandb_entity: str | None = None            # W&B team or user; None = the login's default
    wandb_group: str | None = None             # groups related runs (e.g. a sweep) in the W&B UI
    wandb_tags: list[str] = field(default_factory=list)
    wandb_replay: WandbReplay = "skip"         # steps replayed after a resume: skip them or rewind the run
    run_name: str | None = None                # None = derived from output_dir
    log_every: int = 1                         # optimizer steps between metric lines
    progress_bar: bool = True
    jsonl: bool = True                         # metrics.jsonl in output_dir
    peak_tflops: float | None = None           # per-device peak TFLOP/s for MFU; None = detect (GPU)
    rank_stats_every: int = 10                 # steps between gathers of every rank's step time; 0 = off


@dataclass(frozen=True)
class TrainConfig:
    """The root config. Only the Trainer, the checkpoint manager and observability see all of it."""

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
