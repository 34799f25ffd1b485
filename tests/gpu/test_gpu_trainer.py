"""A whole Trainer run on one GPU (NCCL, world 1): bf16 training with document masking, eval loss by
position and passkey, a synchronous then an async checkpoint save, a resume, `tsp-eval loss` and
`tsp-eval passkey` on the checkpoint, and `tsp-export` of it. The CPU twin is
tests/distributed/test_cuda_path.py::test_whole_run_resume_eval_and_export_keep_every_tensor_on_the_compute_device
(the same run under a CPU-only group with host-default tensors redirected).

Run with `python -m pytest -m gpu`; without a CUDA device it is skipped."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_cuda_path import WHOLE_RUN
from tests.distributed.trainer_cases import config
from tests.helpers.dist import run_on_ranks

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA device (torch.cuda.is_available() is False)")]


def _gpu_run(rank, world, overrides, cli_runs=(), export_to=None):
    from tsp_trainer.checkpoint.export_cli import main as export_main
    from tsp_trainer.eval import cli as eval_cli
    from tsp_trainer.trainer import Trainer

    trainer = Trainer(config(overrides), world_size=world, global_rank=rank, cuda=True)
    resumed_from = trainer.state.step
    history = trainer.fit()
    device = trainer.device
    evaluations = []
    for argv in cli_runs:
        job = eval_cli.prepare(eval_cli.build_parser().parse_args(argv), world_size=world, rank=rank, cuda=True)
        evaluations.append(eval_cli.run(job, rank=rank, device=device))
    if export_to is not None:
        export_main([trainer.cfg.train.output_dir, str(export_to)])
    staging = trainer.checkpoints.writer.staging
    return {"losses": [h["train/loss"] for h in history], "resumed_from": resumed_from,
            "eval": [h.get("eval/loss") for h in history], "device": str(device),
            "pins_batches": getattr(trainer.loader, "pin_memory", None),
            "staging_pinned": None if staging is None else [b.is_pinned() for b in staging._buffers.values()],
            "evaluations": evaluations,
            "weights": {k: v.float().cpu() for k, v in trainer.par.gather_full_state_dict().items()}}


def test_whole_trainer_run_on_one_gpu(tmp_path):
    from tsp_trainer.checkpoint.hf import load_hf_state_dict
    from tsp_trainer.config import load_config

    out = str(tmp_path / "run")
    common = [f"train.output_dir={out}", "parallel.tsp_degree=1", "train.dtype=bf16", *WHOLE_RUN]
    first = run_on_ranks(_gpu_run, 1, common + ["train.steps=2"], backend="nccl")[0]
    cli = ["--micro-batch-size", "2", "--tsp-degree", "1", "--out", str(tmp_path / "eval")]
    second = run_on_ranks(_gpu_run, 1, common + ["train.steps=3", "train.resume=auto",
                                                 "optim.on_resume_change=recipe",
                                                 "checkpoint.async_save=true"],
                          [["loss", out, "--batches", "1", *cli],
                           ["passkey", out, "--lengths", "128", "--depths", "0,1", "--samples", "2",
                            "--digits", "3", *cli]], str(tmp_path / "hf"), backend="nccl")[0]
    assert first["device"].startswith("cuda") and first["pins_batches"] is True
    assert all(loss == loss and 5.0 < loss < 8.0 for loss in first["losses"] + second["losses"])
    assert first["eval"][1] is not None and 5.0 < first["eval"][1] < 8.0
    assert second["resumed_from"] == 2 and len(second["losses"]) == 1
    assert second["staging_pinned"] and all(second["staging_pinned"])      # pinned_staging default
    loss, passkey = second["evaluations"]
    assert sum(loss.tokens) == 2 * 64 and [c.samples for c in passkey.cells] == [2, 2]
    model_cfg = load_config(str(tmp_path / "run" / "config.yaml"), []).model.to_model_config()
    exported = load_hf_state_dict(tmp_path / "hf", model_cfg)
    for name, weight in second["weights"].items():
        assert exported[name].float().equal(weight), name
