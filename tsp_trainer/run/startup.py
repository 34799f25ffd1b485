"""Start-up decisions every rank shares, taken once for the job.

    inputs = reuse_launcher_check(cfg, world_size=world, rank=rank) or check_inputs(...)
    group = join_job(cuda=cuda, timeout_s=...)            # the job's default process group
    resolved = agree_on_settings(cfg, inputs, world=group, ...)   # rank 0 decides, every rank takes it

The `auto` memory settings depend on a memory reading (plan/auto.py `device_budget`) that two
ranks of one job can see differently (a shared GPU node, another job's host memory); two ranks
that chose different modes, buckets or chunks would issue collectives that no longer match.
So global rank 0 decides (its own input check on CPU, the launcher's, or after its device is set
on a GPU) and broadcasts the answer before the mesh is built; a refusal is broadcast too, so every
rank raises the same AutoSettingsError and the CLI prints it once (exit 2).

tsp-launch checks the recipe and its inputs in one process before any rank starts; it writes what
it found (data plan, resume choice; not the tokenizer, which each rank loads) as JSON
to a private file named by CHECKED_INPUTS_ENV, and each rank whose recipe, overrides and world
size are the launcher's takes it instead of checking again (`reuse_launcher_check`).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from tsp_trainer.config import TrainConfig
from tsp_trainer.data import DataPlan, load_run_tokenizer
from tsp_trainer.parallel.comm import Comm
from tsp_trainer.parallel.ledger import CommLedger
from tsp_trainer.plan.resolve import AutoSettingsError, Resolved, resolve_run
from tsp_trainer.run.inputs import CheckedInputs, check_inputs

CHECKED_INPUTS_ENV = "TSP_TRAINER_CHECKED_INPUTS"


@dataclasses.dataclass(frozen=True)
class _RankZeroFailed:
    """What rank 0 broadcasts instead of a decision: its error, and whether it is bad input."""

    message: str
    bad_input: bool

    def raise_here(self):
        if self.bad_input:                  # agreed: every rank raises it, rank 0 prints it
            raise AutoSettingsError(self.message)
        raise RuntimeError(f"global rank 0 failed while resolving the run's settings: {self.message}")


def join_job(*, cuda: bool, timeout_s: float, device: torch.device) -> Comm | None:
    """The job's default process group (gloo on CPU, NCCL on GPUs, from the launcher's
    environment; Accelerate then uses it) as a Comm over every rank, its control messages on
    `device`; None for a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and not dist.is_initialized():
        return None
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s))
    return Comm(dist.group.WORLD, list(range(dist.get_world_size())), dist.get_rank(), CommLedger(),
                "world", device=device)


def agree_on_settings(cfg: TrainConfig, decided: Resolved | None, *, world: Comm | None, rank: int,
                      world_size: int, cuda: bool, device=None,
                      refuses: Callable[[TrainConfig], None] | None = None) -> Resolved:
    """Rank 0's Resolved (`decided`, or resolved here on this device), taken by every rank of
    `world`. A refusal on rank 0 raises AutoSettingsError on every rank."""
    answer = None
    if rank == 0:
        try:
            answer = decided or resolve_run(cfg, world_size=world_size, cuda=cuda, device=device,
                                            refuses=refuses)
        except ValueError as err:
            answer = _RankZeroFailed(str(err), bad_input=True)
        except BaseException as err:            # the peers must not wait for a decision that never comes
            if world is not None:
                world.broadcast_object(_RankZeroFailed(f"{type(err).__name__}: {err}", bad_input=False))
            raise
    if world is not None:
        answer = world.broadcast_object(answer, src=0)
    if isinstance(answer, _RankZeroFailed):
        answer.raise_here()
    return answer


# -- the launcher's check, reused by its ranks ----------------------------------------------------
def hand_over_check(cfg: TrainConfig, inputs: CheckedInputs, *, world_size: int, first_rank: int,
                    ranks_here: int) -> Path:
    """Write what the launcher's check found for the ranks it starts (global ranks first_rank ..
    first_rank + ranks_here - 1) to a private JSON file; returns its path (the caller removes it).
    Plain data only: the data plan, the resume choice and its meta.json (rank 0 decides `auto`
    itself once its process group exists, and each rank loads its own tokenizer)."""
    fd, path = tempfile.mkstemp(prefix="tsp_trainer_checked_", suffix=".json")
    record = {"cfg": _plain(cfg.to_dict()), "world_size": world_size, "first_rank": first_rank,
              "ranks_here": ranks_here, "data_plan": dataclasses.asdict(inputs.data_plan),
              "resume_path": None if inputs.resume_path is None else str(inputs.resume_path),
              "resume_meta": inputs.resume_meta, "resume_warnings": list(inputs.resume_warnings),
              "resume_notes": list(inputs.resume_notes)}
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    return Path(path)


def _plain(value):
    """`value` as JSON reads it back (tuples become lists), so two configs compare as data."""
    return json.loads(json.dumps(value))


def reuse_launcher_check(cfg: TrainConfig, *, world_size: int, rank: int) -> CheckedInputs | None:
    """The launcher's CheckedInputs for this rank when CHECKED_INPUTS_ENV names a check of this
    very config and world size that covers this rank; None otherwise (the rank checks itself)."""
    path = os.environ.get(CHECKED_INPUTS_ENV)
    if not path:
        return None
    try:
        with open(path) as f:
            record = json.load(f)
        first = record["first_rank"]
        same = (record["cfg"] == _plain(cfg.to_dict()) and record["world_size"] == world_size
                and first <= rank < first + record["ranks_here"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not same:
        return None
    tokenizer = load_run_tokenizer(cfg.data.tokenizer, cfg.model)
    # as check_inputs on any other rank: under resume=auto rank 0 alone chooses (it tells the
    # others once the groups exist) and alone prints the resume lines
    mine = rank == first or cfg.train.resume != "auto"
    resume = record["resume_path"] if mine else None
    return CheckedInputs(tokenizer, DataPlan(**record["data_plan"]),
                         None if resume is None else Path(resume),
                         record["resume_meta"] if mine else None,
                         tuple(record["resume_warnings"]) if rank == first else (),
                         tuple(record["resume_notes"]) if rank == first else ())


def settle(cfg: TrainConfig, inputs: CheckedInputs, *, world_size: int, rank: int, cuda: bool, device,
           refuses: Callable[[TrainConfig], None] | None = None) -> Resolved:
    """Join the job's process group, then take rank 0's decision (`agree_on_settings`)."""
    world = join_job(cuda=cuda, timeout_s=cfg.train.collective_timeout_s, device=device)
    return agree_on_settings(cfg, inputs.resolved, world=world, rank=rank, world_size=world_size,
                             cuda=cuda, device=device, refuses=refuses)


def prepare_run(cfg: TrainConfig, *, world_size: int, rank: int, cuda: bool, device,
                refuses: Callable[[TrainConfig], None] | None = None) -> tuple[CheckedInputs, Resolved]:
    """The input check and the agreed settings of a Trainer built directly (tests, notebooks):
    the steps tsp-train runs before it builds one (cli.py)."""
    inputs = check_inputs(cfg, world_size=world_size, rank=rank)
    return inputs, settle(cfg, inputs, world_size=world_size, rank=rank, cuda=cuda, device=device,
                          refuses=refuses)
