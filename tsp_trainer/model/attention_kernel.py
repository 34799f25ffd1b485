"""Which attention kernel a CUDA run uses (train.attention_kernel), decided once per run and passed
to the model (Transformer(attention_kernel=)).

torch's SDPA flash path runs its vendored FlashAttention-2 unless
`torch.nn.attention.activate_flash_attention_impl` swaps in FA3 (sm90) or FA4 (sm90/sm100) for
the process; cuDNN attention is a separate backend that takes square causal calls only (no
lower-right bias, no varlen), so it serves tsp_degree 1 without document masking. fp32, or head_dim
> 256, takes no flash kernel: memory-efficient attention (model/attention_route.py). `auto` takes
the first of fa3, fa4, fa2 installed and able to run; a forced kernel that cannot run is refused in
one line before any process group. `select_attention_kernel` and `precheck_attention_kernel` are
pure; `check_run_attention_kernel` (check-inputs) and `run_attention_kernel` (the Trainer) apply
them to a run.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tsp_trainer.config import ModelConfig, TrainConfig

FLASH_MAX_HEAD_DIM = 256
HALF_DTYPES = ("bf16", "fp16")
AUTO_ORDER = ("fa3", "fa4", "fa2")       # fastest first where each runs


@dataclass(frozen=True)
class KernelSpec:
    """What one kernel takes: compute-capability majors, and the call shapes it supports."""

    majors: tuple[int, ...] | None      # None: any major >= 8
    bottom_right: bool                  # a query block against a longer key prefix
    varlen: bool                        # packed documents (cu_seqlens)
    install: str                        # how to get it when it is missing
    device_text: str


KERNELS = {
    "fa2": KernelSpec(None, True, True, "a CUDA build of torch", "sm80 or newer"),
    "fa3": KernelSpec((9,), True, True, "flash_attn_interface (FlashAttention-3, built from the "
                      "flash-attention repository's hopper/ folder; no wheel on PyPI)", "sm90 (Hopper)"),
    "fa4": KernelSpec((9, 10), True, True, "the flash-attn-4 package (pip install 'tsp-trainer[gpu]')",
                      "sm90 or sm100 (Hopper, B200/GB200)"),
    "cudnn": KernelSpec(None, False, False, "a torch build with cuDNN 9", "sm80 or newer"),
}


@dataclass(frozen=True)
class Choice:
    """The kernel that runs: fa2 | fa3 | fa4 | cudnn | efficient (CUDA, no flash kernel takes the
    dtype/head_dim) | cpu (SDPA's CPU kernels); `reason` says why, for the start-up log;
    `gqa_path` the run's train.attention_gqa (model/attention_route.py GQA_PATHS), resolved."""

    kernel: str
    reason: str
    gqa_path: str = "native"

    def model_kwargs(self) -> dict[str, str]:
        """The model's attention arguments (Transformer(attention_kernel=, attention_gqa=))."""
        return {"attention_kernel": self.kernel, "attention_gqa": self.gqa_path}


def _refusal(kernel: str, *, capability: tuple[int, int] | None, dtype: str, head_dim: int,
             available: frozenset[str], needs_varlen: bool, needs_prefix: bool) -> str | None:
    """Why `kernel` cannot run this job, or None when it can (capability None: not read yet,
    that rule is skipped)."""
    spec = KERNELS[kernel]
    if kernel not in available:
        return f"{kernel} is not installed (it needs {spec.install})"
    if capability is not None:
        major = capability[0]
        if major < 8 or (spec.majors is not None and major not in spec.majors):
            return (f"{kernel} needs compute capability {spec.device_text}, this GPU is "
                    f"sm{major}{capability[1]}")
    if dtype not in HALF_DTYPES:
        return f"{kernel} takes bf16 or fp16, train.dtype is {dtype}"
    if head_dim > FLASH_MAX_HEAD_DIM:
        return f"{kernel} takes head_dim <= {FLASH_MAX_HEAD_DIM}, the model's is {head_dim}"
    if needs_prefix and not spec.bottom_right:
        return (f"{kernel} has no bottom-right causal call for a query block against its key prefix "
                "(parallel.tsp_degree > 1 needs it)")
    if needs_varlen and not spec.varlen:
        return f"{kernel} has no varlen call (data.document_masking needs it)"
    return None


def _refuse(requested: str, why_not: str) -> ValueError:
    return ValueError(f"train.attention_kernel={requested}: {why_not}; use auto or another kernel")


def select_attention_kernel(requested: str, *, capability: tuple[int, int] | None, dtype: str,
                            head_dim: int, gqa: bool, available: frozenset[str],
                            needs_varlen: bool, needs_prefix: bool) -> Choice:
    """The kernel for train.attention_kernel=`requested` (auto | fa2 | fa3 | fa4 | cudnn) on a
    device of `capability` (None: CPU) in `dtype` (bf16 | fp16 | fp32), with the kernels in
    `available` installed. ValueError (one line, naming the key) for a forced kernel that cannot
    run."""
    if capability is None:
        if requested != "auto":
            raise ValueError(f"train.attention_kernel={requested}: a CPU run has no {requested} "
                             "kernel (CPU attention uses SDPA's CPU kernels); use auto")
        return Choice("cpu", "CPU: SDPA's CPU kernels")
    facts = dict(capability=capability, dtype=dtype, head_dim=head_dim, available=available,
                 needs_varlen=needs_varlen, needs_prefix=needs_prefix)
    if requested != "auto":
        why_not = _refusal(requested, **facts)
        if why_not is not None:
            raise _refuse(requested, why_not)
        expanded = gqa and requested == "cudnn"
        return Choice(requested, "train.attention_kernel" + (", K/V heads expanded for GQA" if expanded else ""))
    if dtype not in HALF_DTYPES or head_dim > FLASH_MAX_HEAD_DIM:
        return Choice("efficient", f"auto: {dtype}, head_dim {head_dim} takes no flash kernel")
    skipped = []
    for kernel in AUTO_ORDER:
        why_not = _refusal(kernel, **facts)
        if why_not is None:
            return Choice(kernel, "auto" + (f"; {'; '.join(skipped)}" if skipped else ""))
        skipped.append(why_not)
    raise ValueError(f"train.attention_kernel=auto: no flash kernel runs here ({'; '.join(skipped)})")


def precheck_attention_kernel(requested: str, *, cuda: bool, dtype: str, head_dim: int,
                              available: frozenset[str], needs_varlen: bool, needs_prefix: bool) -> None:
    """The rules a forced kernel must keep that need no CUDA context (the check-inputs phase runs
    before CUDA initialises): ValueError on a CPU run, a missing kernel, the dtype, head_dim,
    prefix and varlen calls. The compute capability is checked when the Trainer selects."""
    if not cuda:                       # refuses any forced kernel
        select_attention_kernel(requested, capability=None, dtype=dtype, head_dim=head_dim, gqa=False,
                                available=available, needs_varlen=needs_varlen, needs_prefix=needs_prefix)
        return
    if requested == "auto":
        return
    why_not = _refusal(requested, capability=None, dtype=dtype, head_dim=head_dim, available=available,
                       needs_varlen=needs_varlen, needs_prefix=needs_prefix)
    if why_not is not None:
        raise _refuse(requested, why_not)


def _run_facts(cfg: TrainConfig, model_cfg: ModelConfig, *, cuda: bool) -> dict:
    """What the selection reads of a run: train.dtype (resolved for the device), the model's heads,
    the kernels installed, and whether the run makes prefix (tsp_degree > 1) or varlen calls."""
    from tsp_trainer.config.schema import resolved_dtype

    return dict(dtype=resolved_dtype(cfg.train.dtype, cuda), head_dim=model_cfg.head_dim,
                available=installed_attention_kernels() if cuda else frozenset(),
                needs_varlen=cfg.data.document_masking, needs_prefix=cfg.parallel.tsp_degree > 1)


def check_run_attention_kernel(cfg: TrainConfig, model_cfg: ModelConfig) -> None:
    """precheck_attention_kernel for a run on this machine (CUDA when torch sees a GPU)."""
    import torch

    cuda = torch.cuda.is_available()          # does not initialise CUDA
    facts = _run_facts(cfg, model_cfg, cuda=cuda)
    precheck_attention_kernel(cfg.train.attention_kernel, cuda=cuda, **facts)
    chunk = cfg.parallel.attention_chunk_tokens
    if cuda and chunk != "auto" and facts["dtype"] not in HALF_DTYPES:
        raise ValueError(f"parallel.attention_chunk_tokens={chunk} on CUDA runs flash attention per "
                         f"block, which takes bf16 or fp16, train.dtype is {facts['dtype']}; use "
                         "parallel.attention_chunk_tokens=auto or train.dtype=bf16")


def run_attention_kernel(cfg: TrainConfig, model_cfg: ModelConfig, *, device) -> Choice:
    """select_attention_kernel for a run on `device` (a torch.device), with the run's
    train.attention_gqa (concrete: plan/resolve.py resolved `auto`)."""
    import dataclasses

    import torch

    cuda = device.type == "cuda"
    choice = select_attention_kernel(
        cfg.train.attention_kernel, capability=torch.cuda.get_device_capability(device) if cuda else None,
        gqa=model_cfg.num_heads != model_cfg.num_kv_heads, **_run_facts(cfg, model_cfg, cuda=cuda))
    return dataclasses.replace(choice, gqa_path=cfg.train.attention_gqa)


def installed_attention_kernels() -> frozenset[str]:
    """The kernels this environment has: torch's own FA2 and cuDNN attention (CUDA builds); FA3
    when `flash_attn_interface` imports and registers torch.ops.flash_attn_3.fwd / bwd, FA4 when
    `flash_attn.cute.interface` imports with _flash_attn_fwd / _flash_attn_bwd (what torch's
    activation needs; PyPI's flash_attn_interface 0.0.1 is an empty placeholder with neither).
    Importing them loads their libraries, without initialising CUDA."""
    import torch

    found = set()
    if torch.backends.cuda.is_flash_attention_available():
        found.add("fa2")
    if torch.backends.cudnn.is_available() and (torch.backends.cudnn.version() or 0) >= 90000:
        found.add("cudnn")
    if _imports("flash_attn_interface") is not None and all(
            hasattr(torch.ops.flash_attn_3, op) for op in ("fwd", "bwd")):
        found.add("fa3")
    fa4 = _imports("flash_attn.cute.interface")
    if fa4 is not None and all(hasattr(fa4, f) for f in ("_flash_attn_fwd", "_flash_attn_bwd")):
        found.add("fa4")
    return frozenset(found)


def _imports(name: str):
    """Module `name`, or None when it is absent or fails to import (a broken install counts as
    absent: a forced kernel is then refused as not installed)."""
    try:
        if importlib.util.find_spec(name) is None:
            return None
        return importlib.import_module(name)
    except Exception:              # ImportError, or whatever a compiled extension raises on load
        return None
