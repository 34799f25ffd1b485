"""Test-wide set-up: offline, quiet, single-threaded ranks; heavy imports prewarmed in the parent
so forked ranks inherit them instead of each paying the import."""

import os
import tempfile

_tmp = tempfile.mkdtemp(prefix="tsp_tests_")
for key, value in {"DS_ACCELERATOR": "cpu", "WANDB_MODE": "disabled", "WANDB_SILENT": "true",
                   "WANDB_CACHE_DIR": os.path.join(_tmp, "wandb_cache"), "HF_HUB_OFFLINE": "1",
                   "HF_DATASETS_OFFLINE": "1", "HF_HOME": os.path.join(_tmp, "hf"),
                   "TORCH_EXTENSIONS_DIR": os.path.join(_tmp, "torch_ext"),
                   "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(key, value)

import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def _prewarm_heavy_imports() -> None:
    """Import what every forked rank would otherwise import itself (~2-5 s per rank): torch._dynamo
    (first optimizer), DeepSpeed's engine and ZeRO (muon calls torch.compile at import),
    Accelerate, datasets; and skip DeepSpeed's JIT build of its CPU shared-memory op."""
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    import torch._dynamo  # noqa: F401
    import accelerate  # noqa: F401
    import datasets  # noqa: F401
    import deepspeed  # noqa: F401
    import deepspeed.runtime.engine  # noqa: F401
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    import deepspeed.runtime.zero.stage_1_and_2  # noqa: F401
    import transformers  # noqa: F401

    from tsp_trainer.engine.deepspeed import skip_cpu_shm_build
    skip_cpu_shm_build()
    datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN = 0   # parquet streaming sleeps 5 s otherwise


_prewarm_heavy_imports()
