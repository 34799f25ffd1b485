"""Command-line entry points: tsp-train, tsp-launch, tsp-bench, tsp-plan, tsp-export,
tsp-dashboard, tsp-report, tsp-tokenize, tsp-eval, and `python -m tsp_trainer check`.

This is the one place that reads the launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK) and
the one owner of process-group start-up: the Trainer's Accelerator initialises it once, and every
rank leaves through destroy_process_group + os._exit (DeepSpeed + gloo can abort in interpreter
finalisation otherwise, after the job's work is done).

tsp-train exit codes: 0 done; 2 bad input (config, data, tokenizer, output folder, resume path:
found by run/inputs.py before any process group starts; rank 0 prints one line, the other ranks
exit silently); 75 stopped early at a checkpoint by a preemption signal or train.max_runtime_min
(continue with train.resume=auto); 130 stopped at a checkpoint by Ctrl-C (SIGINT; a second
Ctrl-C, or one during start-up, stops at once without one); 1 anything else (a traceback), and a
worker whose launcher died (it stops within a second, without saving: _stop_with_launcher).

One job per output folder: global rank 0 takes the folder's lease (run/lease.py) right after the
config is checked; a folder another live job holds is a bad input (exit 2, one line naming it).

tsp-launch runs the same checks once, in its own process, before Accelerate's launcher starts any
rank (bad input: one line, exit 2, no launcher report); then the launcher, whose exit code is the
first failed rank's (engine/launch.py). `check` runs the checks alone, for other launchers
(launch/torchrun.sh).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import signal
import socket
import sys
import time

EXIT_BAD_INPUT = 2       # tsp_trainer.run.EXIT_BAD_INPUT (not imported here: it pulls in torch)
EXIT_PREEMPTED = 75      # tsp_trainer.run.EXIT_PREEMPTED
EXIT_INTERRUPTED = 130   # tsp_trainer.run.EXIT_INTERRUPTED (Ctrl-C)
_STARTED = time.monotonic()   # ~ the process's start: this module imports nothing heavy
_LAUNCHER = os.getppid()      # the parent at start, before a launcher's death could reparent us


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


def nccl_env(*, blocking_wait: bool) -> dict[str, str]:
    """Environment for ProcessGroupNCCL (read when the process group is created). torch 2.13's
    default (TORCH_NCCL_ASYNC_ERROR_HANDLING=3) lets NCCL's watchdog thread tear the process down
    when an op exceeds the group's timeout: the job dies (non-zero) but no Python exception names
    the op. TORCH_NCCL_BLOCKING_WAIT=1 makes every wait() block the host until the op completes or
    times out and raise DistBackendError in the caller, which Comm turns into CommError (op, axis,
    peers), at the cost of the host running ahead of the GPU (docs/reliability.md "Stalls")."""
    return {"TORCH_NCCL_BLOCKING_WAIT": "1"} if blocking_wait else {}


# Against fragmentation of the CUDA caching allocator (long-context steps free and reallocate
# buffers of many sizes); applied before CUDA initialises, unless the user set an allocator config.
DEFAULT_CUDA_ALLOC_CONF = "expandable_segments:True"
_ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")   # torch reads both names


def default_allocator_env(environ) -> dict[str, str]:
    """The allocator settings to add to `environ`: expandable segments unless the user set one of
    torch's allocator variables (their value is kept as it is)."""
    if any(name in environ for name in _ALLOC_CONF_VARS):
        return {}
    return {"PYTORCH_CUDA_ALLOC_CONF": DEFAULT_CUDA_ALLOC_CONF}


def cuda_device_index(local_rank: int, visible: int, local_world_size: int | None) -> int:
    """Which visible GPU this process uses. One GPU per task (SLURM --gpus-per-task=1, or a
    launcher that sets CUDA_VISIBLE_DEVICES per process) shows each process one device: index 0
    whatever LOCAL_RANK is. When every process sees the node's GPUs (torchrun), LOCAL_RANK."""
    if visible < 1:
        raise ValueError("no CUDA device is visible to this process (CUDA_VISIBLE_DEVICES?)")
    if visible == 1:
        return 0
    if local_rank < visible and (local_world_size is None or local_world_size <= visible):
        return local_rank
    raise ValueError(f"LOCAL_RANK={local_rank} with {visible} visible GPUs and LOCAL_WORLD_SIZE="
                     f"{local_world_size}: give each process one GPU (CUDA_VISIBLE_DEVICES) or every "
                     f"process all of the node's GPUs (at most {visible} processes per node)")


def _prepare_runtime(local_rank: int, world_size: int, *, nccl_blocking_wait: bool = False,
                     say_threads: str | None = None) -> bool:
    """Device, allocator and threads (run/threads.py; `say_threads`: the program name under which
    rank 0 prints the count); returns whether CUDA is used."""
    os.environ.update(default_allocator_env(os.environ))      # before CUDA initialises
    import torch

    cuda = torch.cuda.is_available()
    if cuda:
        local_world = os.environ.get("LOCAL_WORLD_SIZE")
        torch.cuda.set_device(cuda_device_index(local_rank, torch.cuda.device_count(),
                                                int(local_world) if local_world else None))
        os.environ.update(nccl_env(blocking_wait=nccl_blocking_wait))
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from tsp_trainer.run.threads import set_intra_op_threads

    line = set_intra_op_threads()           # ranks oversubscribing the cores run several times slower
    if say_threads:
        print(f"{say_threads}: {line}", flush=True)
    return cuda


def _exit(code: int) -> None:
    import torch.distributed as dist

    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_initialized():
        if code in (0, EXIT_PREEMPTED, EXIT_INTERRUPTED):    # every rank leaves together (they agreed to)
            dist.barrier()
        dist.destroy_process_group()
    _release_run_lease()
    os._exit(code)


def _quiet_known_warnings(prog: str = "tsp-train") -> None:
    import warnings

    # DeepSpeed still calls the collective names torch 2.13 deprecates, on every call.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    warnings.formatwarning = functools.partial(_one_line_warning, prog)


def _one_line_warning(prog: str, message, category, filename: str, lineno: int, line=None) -> str:
    """A warning as one line, never with its source line echoed: ours as `tsp-train: warning:
    ...` (each names its setting and what to do), a library's with its category and place."""
    if f"{os.sep}tsp_trainer{os.sep}" in filename:
        return f"{prog}: warning: {message}\n"
    return f"{prog}: warning: {message} ({category.__name__}, {os.path.basename(filename)}:{lineno})\n"


def train_main(argv: list[str] | None = None) -> None:
    _quiet_known_warnings()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["convert-checkpoint"]:       # a one-off on a trusted checkpoint, not a run
        from tsp_trainer.checkpoint.convert import main as convert_main

        sys.exit(convert_main(argv[1:]))
    parser = argparse.ArgumentParser(prog="tsp-train", description="Train from a YAML recipe. "
                                     "`tsp-train convert-checkpoint PATH` rewrites checkpoints of "
                                     "the older rank-state format (run it on checkpoints you trust).")
    parser.add_argument("recipe", nargs="?", help="recipes/*.yaml")
    parser.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. train.steps=100")
    parser.add_argument("--help-config", action="store_true",
                        help="print every config key (type, default, allowed values, meaning) and exit")
    parser.add_argument("--markdown", action="store_true",
                        help="with --help-config: as Markdown (the text of docs/config.md)")
    args = parser.parse_args(argv)
    if args.help_config:
        from tsp_trainer.config.reference import config_reference

        print(config_reference(markdown=args.markdown), end="")
        sys.exit(0)
    if args.recipe is None:
        parser.error("the following arguments are required: recipe")
    _stop_with_launcher()
    world, rank, local_rank = _launcher_env()
    _interrupt_stops_at_once(rank)                      # until fit() makes Ctrl-C a stop request
    from tsp_trainer.run.startup import CHECKED_INPUTS_ENV

    # under tsp-launch (it hands its check over), whose own check printed the start-up line already
    cfg, inputs = _check_inputs_or_exit(args.recipe, args.overrides, world=world, rank=rank,
                                        report=CHECKED_INPUTS_ENV not in os.environ)
    cuda = _prepare_runtime(local_rank, world, nccl_blocking_wait=cfg.train.nccl_blocking_wait,
                            say_threads="tsp-train" if rank == 0 else None)
    from tsp_trainer.parallel.comm import CommError
    from tsp_trainer.trainer import CheckpointSaveError, Trainer

    code, trainer = 0, None
    try:
        resolved = _settle(cfg, inputs, world=world, rank=rank, cuda=cuda)
        trainer = Trainer(cfg, world_size=world, global_rank=rank, cuda=cuda, inputs=inputs,
                          resolved=resolved)
        history = trainer.fit()
        code = trainer.stopper.exit_code if trainer.stop_reason else 0
        if rank == 0:
            print(_summary(trainer, history), flush=True)
    except ValueError as err:                           # bad input found after start-up
        if rank == 0 or not getattr(err, "agreed", False):   # agreed by all ranks: say it once
            print(f"tsp-train: error (rank {rank}): {err}", file=sys.stderr)
        code = EXIT_BAD_INPUT
    except CheckpointSaveError as err:                  # its cause (errno, path), once per rank that saw it
        if err.seen_here:
            print(f"tsp-train: error (rank {rank}): {err}", file=sys.stderr)
        code = 1
    except CommError as err:                            # a peer gone (its launcher or node) or stalled
        print(comm_failure_line(err, rank, getattr(trainer, "placement", None)), file=sys.stderr)
        code = 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    _exit(code)


def _settle(cfg, inputs, *, world: int, rank: int, cuda: bool):
    """The job's process group, and the `auto` settings global rank 0 decided for every rank
    (run/startup.py), checked against this device's rules."""
    import torch

    from tsp_trainer.engine.device_support import device_refusal
    from tsp_trainer.run.startup import settle

    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return settle(cfg, inputs, world_size=world, rank=rank, cuda=cuda, device=device,
                  refuses=device_refusal(device))


def comm_failure_line(err, rank: int, placement) -> str:
    """The one line a rank prints for a failed collective (CommError): its node and host and the
    nodes it lost contact with (from the start-up placement, when the mesh got that far), then the
    op, axis, peers and the backend's first line."""
    if placement is None:
        return f"tsp-train: error (rank {rank}): a collective failed: {err}"
    return (f"tsp-train: error (rank {rank}, {placement.where(rank)}): "
            f"{placement.lost_contact(err.ranks, me=rank)}: {err}")


def _check_inputs_or_exit(recipe: str, overrides: list[str], *, world: int, rank: int,
                          prog: str = "tsp-train", report: bool = True, take_lease: bool = True):
    """(config, checked inputs), or exit 2 with one line from rank 0 (the other ranks exit silently).
    Runs before any process group: the config first (standard library + OmegaConf, no torch), the
    W&B credentials of an online run, the run folder's lease (rank 0 takes it: run/lease.py), then
    tokenizer, data, resume path and output folder (run/inputs.py).

    Every rank runs the same checks, and under torchrun / accelerate launch the first rank to exit
    makes the launcher SIGTERM the others, possibly rank 0 before it printed: rank 0 holds SIGTERM
    back until its own check is done, then leaves.

    take_lease=False (the checks of tsp-launch and `check`, which train nothing): the output folder
    must not be held by a live job, but this process does not take it."""
    from tsp_trainer.config import load_config, validate_config

    with _sigterm_held(rank == 0) as held:
        try:
            cfg = load_config(recipe, overrides)
            validate_config(cfg, world)
            from tsp_trainer.observability.wandb_sink import check_wandb_credentials
            from tsp_trainer.run import check_inputs
            from tsp_trainer.run.startup import reuse_launcher_check

            check_wandb_credentials(cfg.logging.wandb_mode)   # before the lease makes the run folder
            _take_run_lease(cfg.train.output_dir, rank, take=take_lease)
            # under tsp-launch: its check of this very recipe, not repeated (run/startup.py)
            inputs = prog == "tsp-train" and reuse_launcher_check(cfg, world_size=world, rank=rank)
            checked = "recipe checked, inputs as tsp-launch checked them" if inputs else \
                "recipe and inputs checked (config, tokenizer, data, resume path, output folder)"
            inputs = inputs or check_inputs(cfg, world_size=world, rank=rank)
        except ValueError as err:
            # One line per job: tsp-train's rank 0 says it; tsp-launch and check are one process
            # per machine and always do.
            if rank == 0 or prog != "tsp-train":
                print(f"{prog}: error: {err}", file=sys.stderr, flush=True)
            sys.exit(EXIT_BAD_INPUT)
    if held:                                           # the launcher is tearing the job down
        sys.exit(128 + signal.SIGTERM)
    if report and rank == 0:    # the first line of a start-up that is otherwise silent for seconds
        print(f"{prog}: start-up: {checked} ({time.monotonic() - _STARTED:.1f} s)", flush=True)
    return cfg, inputs


def launch_main(argv: list[str] | None = None) -> None:
    """tsp-launch [accelerate launch options] RECIPE [key=value ...]: the checks of tsp-train in
    this process at the launcher's world size (on machine 0 only: the job's ranks, and machine 0's
    exit 2 under `srun --kill-on-bad-exit`, stop the other machines), then Accelerate's launcher on
    `-m tsp_trainer train`."""
    _quiet_known_warnings("tsp-launch")
    from tsp_trainer.engine.launch import (launch_first_rank, launch_ranks_here,
                                           launch_world_size, parse_launch_args, run_launcher)

    args = parse_launch_args(argv)
    world = launch_world_size(args)
    from tsp_trainer.run.threads import launcher_thread_env

    os.environ.update(launcher_thread_env(launch_ranks_here(args, world)))   # the ranks inherit it
    # As the first rank of this machine: on a machine other than the first (--machine_rank > 0)
    # the job's rank 0, elsewhere, verifies the resume checkpoint and takes the folder's lease.
    first = launch_first_rank(args, world)
    cfg, inputs = _check_inputs_or_exit(args.recipe, args.overrides, world=world, rank=first,
                                        prog="tsp-launch", take_lease=False)
    from tsp_trainer.run.startup import CHECKED_INPUTS_ENV, hand_over_check

    # the ranks take this check's result instead of repeating it (run/startup.py)
    handed = hand_over_check(cfg, inputs, world_size=world, first_rank=first,
                             ranks_here=launch_ranks_here(args, world))
    os.environ[CHECKED_INPUTS_ENV] = str(handed)
    sys.stdout.flush()
    try:
        code = run_launcher(args, preempt_signals=cfg.train.preempt_signals)
    finally:
        handed.unlink(missing_ok=True)
    sys.exit(code)


def check_main(argv: list[str] | None = None) -> None:
    """python -m tsp_trainer check --world-size N RECIPE [key=value ...]: tsp-train's input checks
    alone (exit 0 with one line, or 2 with the error), before a launcher that has no such step."""
    parser = argparse.ArgumentParser(prog="tsp-check", description="Check a recipe and its inputs "
                                     "(config, tokenizer, data, resume path, output folder) for a "
                                     "run of --world-size processes, without starting it.")
    parser.add_argument("--world-size", type=int, default=1, help="processes of the run (default 1)")
    parser.add_argument("--first-rank", type=int, default=0,
                        help="global rank of this machine's first process (default 0); on a machine "
                             "other than the first the job's rank 0 verifies the resume checkpoint "
                             "and takes the output folder's lease, so this check leaves both to it")
    parser.add_argument("recipe", help="recipes/*.yaml")
    parser.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. train.steps=100")
    args = parser.parse_args(argv)
    cfg, _ = _check_inputs_or_exit(args.recipe, args.overrides, world=args.world_size,
                                   rank=args.first_rank, prog="tsp-check", report=False, take_lease=False)
    tsp = cfg.parallel.tsp_degree
    print(f"tsp-check: ok: {args.recipe} on {args.world_size} processes (dp {args.world_size // tsp} "
          f"x tsp {tsp}), output {cfg.train.output_dir}")
def _take_run_lease(output_dir: str, rank: int, *, take: bool) -> None:
    """run/lease.py take_for_job; LeaseHeld is a ValueError: the caller's one line and exit 2."""
    from tsp_trainer.run.lease import take_for_job

    take_for_job(output_dir, rank, take=take, warn=lambda line: print(line, file=sys.stderr, flush=True))


def _release_run_lease() -> None:
    lease = sys.modules.get("tsp_trainer.run.lease")       # imported only if one was taken
    if lease is not None:
        lease.release_held()


def _stop_with_launcher() -> None:
    """Under torchrun / accelerate launch (TORCHELASTIC_RUN_ID set), stop when the launcher dies
    (run/launcher_watch.py); a plain tsp-train outlives its shell (nohup) as it should."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        from tsp_trainer.run.launcher_watch import stop_with_launcher

        stop_with_launcher(_LAUNCHER, on_gone=_release_run_lease)


def _interrupt_stops_at_once(rank: int) -> None:
    """Ctrl-C before training (or after it) ends the process at once: one line from rank 0, exit
    130, no traceback; there is nothing to save. During fit() it is a stop request instead
    (run/preemption.py)."""
    def interrupted(signum, frame):
        if rank == 0:
            os.write(2, b"tsp-train: interrupted (Ctrl-C) outside the training loop: stopped, nothing saved\n")
        _release_run_lease()
        os._exit(EXIT_INTERRUPTED)
    signal.signal(signal.SIGINT, interrupted)


@contextlib.contextmanager
def _sigterm_held(hold: bool):
    """Within the block a SIGTERM is recorded instead of killing the process; the yielded list is
    non-empty afterwards if one came."""
    received: list[int] = []
    if not hold:
        yield received
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)


def _summary(trainer, history: list[dict]) -> str:
    cfg, step = trainer.cfg, trainer.state.step
    where = (f"checkpoints in {cfg.train.output_dir}/checkpoints" if cfg.checkpoint.enabled
             else "no checkpoints (checkpoint.enabled=false)")
    if trainer.stop_reason:
        return (f"tsp-train: stopped after step {step} of {cfg.train.steps} ({trainer.stop_reason}); "
                f"{where}; relaunch with train.resume=auto to continue (exit code "
                f"{trainer.stopper.exit_code})")
    if not history:
        return f"tsp-train: done: nothing to do, the run is at step {step} of {cfg.train.steps}; {where}"
    from tsp_trainer.observability.summary import loss_summary

    return f"tsp-train: done: {step} steps, {loss_summary(history, last_step=step)}, {where}"


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
    _quiet_known_warnings("tsp-eval")
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
        # the device _prepare_runtime chose (cuda_device_index: 0 under one GPU per task)
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
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


COMMANDS = {"train": train_main, "launch": launch_main, "check": check_main, "bench": bench_main,
            "plan": plan_main, "export": export_main, "dashboard": dashboard_main, "report": report_main,
            "tokenize": tokenize_main, "eval": eval_main}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m tsp_trainer {{{','.join(COMMANDS)}}} ...", file=sys.stderr)
        sys.exit(2)
    COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
