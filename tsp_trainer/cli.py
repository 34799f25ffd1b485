"""Command-line entry points: tsp-train, tsp-bench, tsp-plan, tsp-export, tsp-dashboard,
tsp-report, tsp-tokenize, tsp-eval.

This is the one place that reads the launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK) and
the one owner of process-group start-up: the Trainer's Accelerator initialises it once, and every
rank leaves through destroy_process_group + os._exit (DeepSpeed + gloo can abort in interpreter
finalisation otherwise; ENV_NOTES.md section 3).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys


def _launcher_env() -> tuple[int, int, int]:
    """(world_size, rank, local_rank) from torchrun / accelerate launch / SLURM, defaulting to a
    single process (with a free local port so a plain `tsp-train` works)."""
    if "WORLD_SIZE" not in os.environ and "SLURM_NTASKS" in os.environ:
        os.environ.update(WORLD_SIZE=os.environ["SLURM_NTASKS"], RANK=os.environ["SLURM_PROCID"],
                          LOCAL_RANK=os.environ.get("SLURM_LOCALID", "0"))
    if "WORLD_SIZE" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    return int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))


def _prepare_runtime(local_rank: int, world_size: int) -> bool:
    """Device and threads; returns whether CUDA is used."""
    import torch

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        if world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(1)        # oversubscribed ranks run ~3x slower (ENV_NOTES.md 8)
    return cuda


def _exit(code: int) -> None:
    import torch.distributed as dist

    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_initialized():
        if code == 0:
            dist.barrier()
        dist.destroy_process_group()
    os._exit(code)


def _quiet_known_warnings() -> None:
    import warnings

    # DeepSpeed still calls the collective names torch 2.13 deprecates, on every call.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


def train_main(argv: list[str] | None = None) -> None:
    _quiet_known_warnings()
    parser = argparse.ArgumentParser(prog="tsp-train", description="Train from a YAML recipe.")
    parser.add_argument("recipe", help="recipes/*.yaml")
    parser.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. train.steps=100")
    args = parser.parse_args(argv)
    from tsp_trainer.config import load_config, validate_config

    try:
        cfg = load_config(args.recipe, args.overrides)
        world, rank, local_rank = _launcher_env()
        validate_config(cfg, world)                    # before any process-group work
    except ValueError as err:
        print(f"tsp-train: error: {err}", file=sys.stderr)
        sys.exit(2)
    cuda = _prepare_runtime(local_rank, world)
    from tsp_trainer.trainer import Trainer

    code = 0
    try:
        trainer = Trainer(cfg, world_size=world, global_rank=rank, cuda=cuda)
        history = trainer.fit()
        if rank == 0 and history:
            first, last = history[0]["train/loss"], history[-1]["train/loss"]
            print(f"tsp-train: done: {trainer.state.step} steps, loss {first:.4f} -> {last:.4f}, "
                  f"checkpoints in {cfg.train.output_dir}/checkpoints")
    except ValueError as err:                           # bad input found after start-up
        print(f"tsp-train: error (rank {rank}): {err}", file=sys.stderr)
        code = 2
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    _exit(code)


def bench_main(argv: list[str] | None = None) -> None:
    from tsp_trainer.bench.cli import main

    raise SystemExit(main(argv))


def plan_main(argv: list[str] | None = None) -> None:
    from tsp_trainer.plan.cli import main

    raise SystemExit(main(argv))


def export_main(argv: list[str] | None = None) -> None:
    from tsp_trainer.checkpoint.export_cli import main

    raise SystemExit(main(argv))


def eval_main(argv: list[str] | None = None) -> None:
    """tsp-eval: checks everything before the process group, which this module starts (gloo on CPU,
    nccl on GPUs) for the evaluation only: no Accelerate, no DeepSpeed."""
    _quiet_known_warnings()
    from tsp_trainer.eval import cli as eval_cli

    args = eval_cli.build_parser().parse_args(argv)
    if args.command == "retrieval-corpus":
        try:
            out = eval_cli.corpus_main(args)
        except ValueError as err:
            print(f"tsp-eval: error: {err}", file=sys.stderr)
            sys.exit(2)
        print(f"tsp-eval: wrote {out}/train.jsonl and {out}/validation.jsonl")
        return
    world, rank, local_rank = _launcher_env()
    cuda = _prepare_runtime(local_rank, world)
    try:
        job = eval_cli.prepare(args, world_size=world, rank=rank, cuda=cuda)
    except ValueError as err:
        print(f"tsp-eval: error: {eval_cli.as_flags(str(err))}", file=sys.stderr)
        sys.exit(2)
    import datetime

    import torch
    import torch.distributed as dist

    code = 0
    try:
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=600))
        device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
        eval_cli.run(job, rank=rank, device=device)
    except ValueError as err:
        print(f"tsp-eval: error (rank {rank}): {eval_cli.as_flags(str(err))}", file=sys.stderr)
        code = 2
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    _exit(code)


def dashboard_main(argv: list[str] | None = None) -> None:
    from tsp_trainer.observability.dashboard import main

    raise SystemExit(main(argv))


def report_main(argv: list[str] | None = None) -> None:
    from tsp_trainer.observability.report import main

    raise SystemExit(main(argv))


def tokenize_main(argv: list[str] | None = None) -> None:
    from tsp_trainer.data.tokenize_cli import main

    raise SystemExit(main(argv))


COMMANDS = {"train": train_main, "bench": bench_main, "plan": plan_main,
            "export": export_main, "dashboard": dashboard_main, "report": report_main,
            "tokenize": tokenize_main, "eval": eval_main}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m tsp_trainer {{{','.join(COMMANDS)}}} ...", file=sys.stderr)
        sys.exit(2)
    COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
