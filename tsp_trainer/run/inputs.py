"""The "check inputs" phase: everything a user can get wrong, found before any process group,
Accelerate or DeepSpeed starts (seconds instead of the tens of seconds of start-up).

    inputs = check_inputs(cfg, world_size=world, rank=rank)   # ValueError: one line, the CLI exits 2

In order, each cheap: the config against the world size (config/validate.py); a model.init_from
folder's tensor names and shapes against its config.json (file headers only); a forced
train.attention_kernel this machine cannot run (model/attention_kernel.py); on CPU and for global
rank 0 only, the `auto` memory settings (plan/resolve.py: nothing fits the budget; the other ranks
take rank 0's, run/startup.py); the tokenizer loads and fits the model's
vocabulary; the data (data/checks.py check_data_config: sources, format, columns, eval split and
source, token budget); the resume path names a checkpoint that verifies and whose model shape,
layout and optimizer settings (optim.on_resume_change) this run accepts; the output folder is
writable and not another run's (run/rundir.py). The cli runs it on every rank and hands the result
to the Trainer (the tokenizer is not loaded twice); a Trainer built directly runs it itself.
Never imports torch.distributed, accelerate or deepspeed.

The checkpoint is verified here, once, by global rank 0 (the only hashing of a resume: loading
trusts it). Under train.resume=auto rank 0 also sets damaged checkpoints aside, so the other ranks
do not look at the checkpoints folder here: their resume_path is None, and rank 0's choice reaches
them in TrainingCheckpoints.load, after the process groups exist (which rank 0 joins only when
this is done).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tsp_trainer.checkpoint.disk_format import META
from tsp_trainer.checkpoint.hf import check_folder_tensors
from tsp_trainer.checkpoint.reshard import check_layout_change
from tsp_trainer.checkpoint.train_state import check_same_model, checkpoint_layout, saved_config
from tsp_trainer.config import TrainConfig, validate_config
from tsp_trainer.data import DataPlan, check_data_config, check_tokenizer_fits, load_run_tokenizer
from tsp_trainer.data.tokenize import TextTokenizer
from tsp_trainer.model.attention_kernel import check_run_attention_kernel
from tsp_trainer.optim import resume_change_refusal, resume_changes
from tsp_trainer.parallel.mesh import ParallelDims
from tsp_trainer.plan.resolve import Resolved, resolve_run
from tsp_trainer.run.rundir import check_output_dir, choose_resume


@dataclass(frozen=True)
class CheckedInputs:
    tokenizer: TextTokenizer
    data_plan: DataPlan             # data/checks.py: shares, epochs, eval layout, notes
    resume_path: Path | None        # the checkpoint to continue from (None: start at step 0, or
                                    # resume=auto on a rank != 0: rank 0 chooses)
    resume_meta: dict | None        # its meta.json (read here, after rank 0 verified the manifest)
    resume_warnings: tuple[str, ...] = ()   # rank 0: each damaged checkpoint set aside, the fallback
    resume_notes: tuple[str, ...] = ()      # rank 0: the verification of the one chosen
    resolved: Resolved | None = None        # rank 0 on CPU: the `auto` settings decided for every
                                            # rank (on a GPU rank 0 decides once its device is set)


def check_inputs(cfg: TrainConfig, *, world_size: int, rank: int = 0) -> CheckedInputs:
    """Raise ValueError naming the key, the value and the rule on the first bad input.
    rank: this process's global rank (the CLI passes the launcher's; 0 for one process)."""
    validate_config(cfg, world_size)
    model_cfg = cfg.model.to_model_config()
    if cfg.model.init_from is not None:              # the weights are what config.json says
        check_folder_tensors(cfg.model.init_from, model_cfg)
    check_run_attention_kernel(cfg, model_cfg)       # a forced kernel this machine cannot run
    resolved = _cpu_auto_settings(cfg, world_size, rank)     # nothing fits: before any file is read
    tokenizer = load_run_tokenizer(cfg.data.tokenizer, cfg.model)    # or the model folder's
    check_tokenizer_fits(tokenizer, model_cfg.vocab_size)
    data_plan = check_data_config(cfg, world_size // cfg.parallel.tsp_degree, tokenizer=tokenizer)
    choice = choose_resume(cfg.train.resume, cfg.train.output_dir, rank=rank)
    resume_path = choice.path
    meta = None
    if resume_path is not None:
        meta = read_meta(resume_path)
        check_same_model(meta, model_cfg, resume_path)
        check_layout_change(meta["layout"], run_layout(cfg, world_size),
                            policy=cfg.data.on_layout_change, path=resume_path)
        check_resume_settings(meta, cfg, resume_path)
    check_output_dir(cfg.train.output_dir, resume=cfg.train.resume, resume_path=resume_path,
                     overwrite=cfg.train.overwrite_output_dir)
    return CheckedInputs(tokenizer, data_plan, resume_path, meta, choice.warnings, choice.notes,
                         resolved=resolved)


def check_resume_settings(meta: dict, cfg: TrainConfig, path: Path) -> None:
    """A resume whose optimizer or schedule settings differ from the checkpoint's needs
    optim.on_resume_change to say which side wins (optim.py)."""
    changes = resume_changes(saved_config(meta), cfg.to_dict())
    if changes and cfg.optim.on_resume_change is None:
        raise ValueError(f"train.resume: checkpoint {path}: {resume_change_refusal(changes)}")


def _cpu_auto_settings(cfg: TrainConfig, world_size: int, rank: int) -> Resolved | None:
    """Global rank 0's decision of the `auto` settings of a run on this machine's CPU
    (plan/resolve.py; ValueError when nothing fits its share of host memory). The other ranks
    take it once the process group exists. On a GPU machine rank 0 decides after its device is set:
    the budget reads the device's memory, and CUDA must not initialise before the launcher's
    allocator settings."""
    import torch

    if rank != 0 or torch.cuda.is_available():             # does not initialise CUDA
        return None
    return resolve_run(cfg, world_size=world_size, cuda=False)


def read_meta(path: Path) -> dict:
    """meta.json of the checkpoint to resume (read only)."""
    meta = Path(path) / META
    if not meta.is_file():
        raise ValueError(f"train.resume: checkpoint {path} is missing {META}: it is incomplete or "
                         "not a tsp_trainer checkpoint")
    try:
        return json.loads(meta.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"train.resume: checkpoint {path} has an unreadable {META} ({err})") from err


def run_layout(cfg: TrainConfig, world_size: int) -> dict:
    """meta.json's `layout` of a run of `cfg` on `world_size` ranks (before any mesh exists)."""
    return checkpoint_layout(cfg, ParallelDims(world_size=world_size, tsp=cfg.parallel.tsp_degree))
