"""Test-wide set-up: offline, quiet, single-threaded ranks; heavy imports prewarmed in the parent
so forked ranks inherit them (ENV_NOTES.md section 9)."""

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
