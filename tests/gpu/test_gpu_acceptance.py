"""experiments/gpu_acceptance.py on a CUDA device, briefly: the tiny sizes in bf16 (so a flash
kernel serves attention), every part, and what only a GPU shows: the attention kernels read from
the device's kernel names, the allocator's reserved peak, and the copy traffic ordered on side
streams. The full run (7B at 128K, about 4 minutes on an H200) is
`python experiments/gpu_acceptance.py --out ...`; docs/benchmarks.md, "GPU acceptance".

Run with `python -m pytest -m gpu`; without a CUDA device it is skipped with the reason."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.experiments import load_experiment

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA device (torch.cuda.is_available() is False)")]

DEVICE_FAMILIES = {"fa2", "fa2_splitkv", "fa3", "fa4", "cudnn", "efficient"}


def test_tiny_run_on_the_gpu_reads_device_kernels_and_reserved_memory(tmp_path):
    out = tmp_path / "acc.json"
    script = load_experiment("gpu_acceptance")
    assert script.main(["--device", "cuda", "--tiny", "--steps", "2", "--budget-s", "300",
                        "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    t = r["tsp_rank"]
    assert r["allocator"]["PYTORCH_CUDA_ALLOC_CONF"]                 # the trainer's, or the user's
    assert t["peak_reserved_bytes"] >= t["peak_allocated_bytes"] >= t["peak_act_bytes"] > 0
    families = set(t["attention_kernel_families"])
    assert families and families <= DEVICE_FAMILIES                 # device kernels, not aten ops
    assert not any(name.startswith("aten::") for name in t["sdpa_kernels"])
    twin = t["comm_twin"]
    assert twin["copied_bytes_per_step"] == twin["ledger_bytes_per_step"] > 0
    assert twin["scratch_bytes"] > 0
    assert set(r["document_masking"]["attention_kernel_families"]) <= DEVICE_FAMILIES
    assert r["optimizer_step"]["state_bytes"] == 16 * r["optimizer_step"]["param_count"]
    # at tiny sizes the offloaded block inputs are a few KiB next to the loss's logits: no more, not
    # necessarily measurably less after the allocator's rounding
    assert 0 < r["activation_offload"]["peak_act_bytes"] <= t["peak_act_bytes"]
    assert t["mfu"] is None or 0 < t["mfu"] < 1
