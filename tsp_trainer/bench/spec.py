"""The benchmark's typed request (`BenchSpec`) and every check on it, run before any process starts:
unknown scheme, degrees that do not fit the processes or the model, sequence lengths that do not
split. Each failure is one ValueError naming the flag, the value and what would work."""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass

from tsp_trainer.config.model import ModelConfig
from tsp_trainer.config.model_source import model_from_name_or_path
from tsp_trainer.config.schema import resolved_zero_stage
from tsp_trainer.config.validate import check_parallel_shapes, check_sliding_window
from tsp_trainer.parallel.schemes import SCHEMES

# the order tables and plots use: the registry's
ALL_SCHEMES = tuple(SCHEMES)
# --reference: stacks run unmodified beside ours, in launches of their own (tsp_trainer/bench/alst.py)
REFERENCES = ("alst",)


@dataclass(frozen=True)
class BenchSpec:
    model_name: str               # named size (config/model.py) or HF folder the overrides apply to
    model: ModelConfig            # resolved shape
    seq_len: int                  # tokens per sequence (N)
    micro_batch: int              # sequences per step (B); dp = 1
    degree: int                   # D: ranks of the model-parallel group = processes per scheme
    schemes: tuple[str, ...]
    tp_degree: int | None         # tp_x_sp: T (T x S = D)
    sp_degree: int | None         # tp_x_sp: S
    tp_sequence_parallel: bool    # tp_x_sp: Megatron SP inside the tp sub-axis
    head_buckets: int             # tsp: K/V all-gather buckets per weight shard
    steps: int                    # timed steps (0: memory and communication only)
    warmup: int                   # untimed steps before them (>= 1; the first one measures memory)
    backend: str                  # gloo (CPU) | nccl (one GPU per rank)
    dtype: str                    # bf16 | fp32: weights and activations (--dtype auto: the trainer's rule)
    threads: int                  # torch threads per rank
    activation_checkpointing: bool  # wrap every block in torch.utils.checkpoint, all schemes alike
    compare_hf: bool              # time the single-process model against transformers' (its family)
    seed: int
    interleave: bool = True       # all schemes in one launch, timed steps alternating between them
    profile: bool = False         # one more step per scheme under torch.profiler (tsp_trainer/bench/profile.py)
    tsp_recompute: str = "full"   # tsp: full | selective | none (parallel.tsp_recompute)
    reference: str | None = None  # "alst": DeepSpeed's Ulysses for HF models + ZeRO-3 (bench/alst.py)
    # sp, ulysses with their weights whole on every rank under a plain AdamW, instead of sharded by
    # DeepSpeed ZeRO-3 as the trainer runs them (zero.stage auto = 3; bench/zero3.py)
    replicated_weights: bool = False

    def options(self, scheme: str) -> dict:
        """Keyword options of parallelize() for `scheme`."""
        if scheme == "tsp":
            return {"head_buckets": self.head_buckets, "tsp_recompute": self.tsp_recompute}
        if scheme == "tp_x_sp":
            return {"tp_degree": self.tp_degree, "sp_degree": self.sp_degree,
                    "tp_sequence_parallel": self.tp_sequence_parallel}
        return {}

    def zero_stage(self, scheme: str) -> int:
        """The trainer's zero.stage auto where it is 3 (config/schema.py resolved_zero_stage: sp,
        ulysses) unless --replicated-weights; else 0 (whole weights, a plain AdamW)."""
        return 3 if resolved_zero_stage("auto", scheme) == 3 and not self.replicated_weights else 0

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["model"] = dataclasses.asdict(self.model)
        return out


def resolve_model(name: str, overrides: dict[str, int | None], seq_len: int) -> ModelConfig:
    """Named size or Hugging Face folder / config.json, + non-None overrides; max_seq_len raised
    to seq_len if needed."""
    base = model_from_name_or_path(name)
    check_sliding_window(base, seq_len, key="--seq-len")
    changes = {k: v for k, v in overrides.items() if v is not None}
    changes["max_seq_len"] = max(seq_len, base.max_seq_len)
    try:
        return base.replace(**changes)
    except ValueError as err:
        raise ValueError(f"model overrides {changes} for --model={name}: {err}") from None


def parse_schemes(text: str) -> tuple[str, ...]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise ValueError("--schemes is empty; give a comma-separated list from " + ",".join(ALL_SCHEMES))
    for name in names:
        if name not in ALL_SCHEMES:
            raise ValueError(f"--schemes: unknown scheme {name!r}; use a comma-separated list from "
                             f"{','.join(sorted(ALL_SCHEMES))}")
    return tuple(dict.fromkeys(names))


def validate(spec: BenchSpec, *, cuda_devices: int, cpu_count: int | None = None) -> None:
    """Raise ValueError for a request that cannot run; warn for one that runs but is oversubscribed."""
    for flag, value, low in (("--seq-len", spec.seq_len, 1), ("--micro-batch", spec.micro_batch, 1),
                             ("--degree", spec.degree, 1), ("--steps", spec.steps, 0),
                             ("--warmup", spec.warmup, 1), ("--threads", spec.threads, 1),
                             ("--head-buckets", spec.head_buckets, 1)):
        if value < low:
            raise ValueError(f"{flag}={value} must be >= {low}")
    _check_processes(spec, cuda_devices, cpu_count or os.cpu_count() or 1)
    if "tp_x_sp" not in spec.schemes and (spec.tp_degree or spec.sp_degree or spec.tp_sequence_parallel):
        raise ValueError("--tp-degree/--sp-degree/--tp-sequence-parallel are options of scheme tp_x_sp, "
                         "which is not in --schemes; add it or drop them")
    if spec.tsp_recompute != "full" and spec.activation_checkpointing:
        # the trainer's rule (config/validate.py::_check_tsp_recompute): measure what can train
        raise ValueError(f"--tsp-recompute={spec.tsp_recompute} with --activation-checkpointing: the "
                         "checkpoint's replay is TSP's recompute in every mode, keeping one "
                         "block's items (the trainer refuses the pair); drop one of them")
    for scheme in spec.schemes:
        _check_scheme(spec, scheme)
    if spec.reference is not None:
        _check_reference(spec)


def _check_reference(spec: BenchSpec) -> None:
    """--reference alst: DeepSpeed's Ulysses over D ranks, the shapes our `ulysses` accepts."""
    if spec.reference not in REFERENCES:
        raise ValueError(f"--reference={spec.reference!r} is not a reference stack; use one of {','.join(REFERENCES)}")
    if spec.degree < 2:
        raise ValueError(f"--reference=alst with --degree={spec.degree}: DeepSpeed's Ulysses needs "
                         "--degree >= 2 (at 1 it registers nothing)")
    try:
        check_parallel_shapes(spec.model, scheme="ulysses", degree=spec.degree, seq_len=spec.seq_len)
    except ValueError as err:
        raise ValueError(f"--reference=alst with --degree={spec.degree}: {err}") from None


def _check_processes(spec: BenchSpec, cuda_devices: int, cpu_count: int) -> None:
    if spec.backend not in ("gloo", "nccl"):
        raise ValueError(f"--backend={spec.backend!r} must be gloo or nccl")
    if spec.backend == "nccl":
        if spec.degree > cuda_devices:
            raise ValueError(f"--degree={spec.degree} needs {spec.degree} GPUs with --backend=nccl "
                             f"(one process per GPU), but {cuda_devices} are visible; use --degree <= "
                             f"{cuda_devices} or --backend gloo")
    elif spec.degree * spec.threads > cpu_count:
        warnings.warn(f"--degree={spec.degree} x --threads={spec.threads} processes/threads on "
                      f"{cpu_count} CPU cores: ranks are oversubscribed, step times are not "
                      "representative of the scheme (memory and bytes are)", stacklevel=2)


def _check_scheme(spec: BenchSpec, scheme: str) -> None:
    opts = spec.options(scheme)
    two_axes = {k: opts[k] for k in ("tp_degree", "sp_degree")} if scheme == "tp_x_sp" else {}
    if scheme == "tp_x_sp" and (spec.tp_degree is None or spec.sp_degree is None):
        raise ValueError(f"scheme tp_x_sp needs --tp-degree and --sp-degree with T x S = --degree="
                         f"{spec.degree}; e.g. --tp-degree 2 --sp-degree {max(1, spec.degree // 2)}")
    try:
        check_parallel_shapes(spec.model, scheme=scheme, degree=spec.degree, seq_len=spec.seq_len,
                              head_buckets=opts.get("head_buckets", 1), **two_axes)
        if scheme == "tp_x_sp" and spec.tp_sequence_parallel and (spec.seq_len // spec.sp_degree) % spec.tp_degree:
            raise ValueError(f"data.seq_len={spec.seq_len} must be a multiple of 2 x S x T = "
                             f"{2 * spec.sp_degree * spec.tp_degree} with --tp-sequence-parallel")
    except ValueError as err:
        raise ValueError(f"scheme {scheme} with --degree={spec.degree}: {err} (flags: --degree, "
                         "--tp-degree, --sp-degree, --head-buckets, --seq-len, model overrides)") from None
