"""tsp-launch's use of Accelerate's launcher: its own argument parser and `launch_command`, so every
`accelerate launch` flag (--config_file, --num_processes, --machine_rank, ...) means what it means
there, with the training command fixed to `-m tsp_trainer train RECIPE [key=value ...]`.

    args = parse_launch_args(argv)          # RECIPE and overrides: args.recipe, args.overrides
    world = launch_world_size(args)         # the processes the job will start, all machines
    first = launch_first_rank(args, world)  # the global rank of this machine's first process
    code = run_launcher(args)               # the job's exit code (a failed rank's own code)

Under `accelerate launch` a failing rank surfaces as torch elastic's ChildFailedError (a report of
every rank, exit status 1); `run_launcher` turns it into the failed rank's exit code (2: bad input,
75: stopped at a checkpoint) and one line naming the rank.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys

from accelerate.commands.config import default_config_file, load_config_from_file
from accelerate.commands.launch import launch_command, launch_command_parser
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

PROG = "tsp-launch"
EXIT_BAD_INPUT = 2


def build_parser() -> argparse.ArgumentParser:
    """Accelerate's launch parser, its script positionals renamed RECIPE and key=value."""
    parser = launch_command_parser()
    parser.prog = PROG
    parser.description = ("Check a recipe and its inputs in this process, then start Accelerate's "
                          "launcher on `-m tsp_trainer train RECIPE [key=value ...]`. Takes every "
                          "`accelerate launch` option; exit codes are tsp-train's (2 bad input, 75 "
                          "stopped at a checkpoint, 1 anything else).")
    for action in parser._actions:        # argparse keeps no public handle on a positional
        if action.dest == "training_script":
            action.metavar, action.help = "RECIPE", "recipes/*.yaml"
        elif action.dest == "training_script_args":
            action.metavar, action.help = "key=value", "dotlist overrides, e.g. train.steps=100"
    return parser


def parse_launch_args(argv: list[str] | None) -> argparse.Namespace:
    """Accelerate's launch namespace plus `recipe` and `overrides`; exits 2 (argparse) on flags
    that would run something other than tsp_trainer."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag in ("module", "no_python"):
        if getattr(args, flag):
            parser.error(f"--{flag} is not needed: {PROG} runs `-m tsp_trainer train RECIPE` itself")
    args.recipe, args.overrides = args.training_script, list(args.training_script_args)
    return args


def launch_world_size(args: argparse.Namespace) -> int:
    """How many processes the launcher will start in all (Accelerate's num_processes counts every
    machine's): --num_processes, else the config file's (--config_file, else Accelerate's default
    file), else one per visible GPU, at least one."""
    if args.num_processes is not None:
        return args.num_processes
    path = args.config_file or (default_config_file if os.path.isfile(default_config_file) else None)
    if path is not None:
        return max(load_config_from_file(path).num_processes, 1)
    import torch

    return max(torch.cuda.device_count(), 1)


def _launch_config(args: argparse.Namespace):
    path = args.config_file or (default_config_file if os.path.isfile(default_config_file) else None)
    return load_config_from_file(path) if path is not None else None


def launch_machines(args: argparse.Namespace) -> int:
    """--num_machines, else the config file's, else 1."""
    machines = args.num_machines if args.num_machines is not None else getattr(
        _launch_config(args), "num_machines", 1)
    return max(machines or 1, 1)


def launch_first_rank(args: argparse.Namespace, world: int) -> int:
    """The global rank of this machine's first process: --machine_rank (else the config file's,
    else 0) x the processes per machine (`world` over launch_machines)."""
    config = _launch_config(args)
    machine = args.machine_rank if args.machine_rank is not None else getattr(config, "machine_rank", 0)
    return (machine or 0) * (world // launch_machines(args))


def launch_ranks_here(args: argparse.Namespace, world: int) -> int:
    """The processes this machine's launcher starts: `world` over the machines."""
    return world // launch_machines(args)


def run_launcher(args: argparse.Namespace, *, preempt_signals=("SIGTERM", "SIGUSR1")) -> int:
    """Start `python -m tsp_trainer train RECIPE [key=value ...]` under Accelerate's launcher and
    return the job's exit code: 0, the first failed rank's own code, or 128 + the signal that
    stopped the launcher (preempt_signals: the recipe's train.preempt_signals, for its line)."""
    import torch

    if not torch.cuda.is_available():      # else DeepSpeed's import warns that it picked the CPU
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # torch elastic logs a WARNING per signal and per rank it forwards a signal to (five lines for
    # one Ctrl-C on four ranks); the line below names the signal and what the ranks do with it
    import torch.distributed.elastic.agent.server.api  # noqa: F401 (its import sets its level)

    for name in ("torch.distributed.elastic.agent.server.api",
                 "torch.distributed.elastic.multiprocessing.api"):
        logging.getLogger(name).setLevel(logging.ERROR)
    args.module, args.training_script = True, "tsp_trainer"
    args.training_script_args = ["train", args.recipe, *args.overrides]
    try:
        launch_command(args)
    except ChildFailedError as err:
        rank, code, failed = first_failure(err)
        print(f"{PROG}: exit code {code}, rank {rank}'s (the first of {failed} ranks to exit "
              "non-zero; their output is above)", file=sys.stderr, flush=True)
        return code
    except subprocess.CalledProcessError as err:           # Accelerate's one-process launcher
        return exit_code(err.returncode)
    except SignalException as err:
        print(f"{PROG}: stopped by {err.sigval.name}; {what_ranks_do(err.sigval, preempt_signals)}",
              file=sys.stderr, flush=True)
        return 128 + int(err.sigval)
    except ValueError as err:                              # Accelerate's checks of its own options
        print(f"{PROG}: error: {err}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    return 0


def what_ranks_do(sig: signal.Signals, preempt_signals) -> str:
    """What the launcher's ranks do with the signal it forwarded to them (torch elastic sends its
    own; SIGKILL after TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds), as tsp-train handles it."""
    if sig == signal.SIGINT:
        return ("the ranks were sent it too: each saves a checkpoint at its next step boundary and "
                "exits 130 (a second Ctrl-C stops them at once, without one); continue with "
                "train.resume=auto")
    if sig.name in preempt_signals:
        return (f"the ranks were sent it too: {sig.name} is in train.preempt_signals, so each saves "
                "a checkpoint at its next step boundary and exits 75; continue with train.resume=auto")
    return (f"the ranks were sent it too: {sig.name} is not in train.preempt_signals, so they stopped "
            "without a checkpoint; train.resume=auto continues from the latest one")


def first_failure(err: ChildFailedError) -> tuple[int, int, int]:
    """(rank, exit code, ranks failed) of the rank that failed first, leaving out the ranks torch
    elastic then stopped with SIGTERM. A rank killed by another signal (SIGKILL from a user or the
    OOM killer, a segfault) counts as failing first on a tie: failures carry whole seconds, and
    its peers' own exits in that second are their reaction to losing it."""
    failures = err.failures
    own = {r: f for r, f in failures.items() if f.exitcode != -signal.SIGTERM} or failures
    rank = min(own, key=lambda r: (own[r].timestamp, own[r].exitcode > 0, r))
    return rank, exit_code(own[rank].exitcode), len(failures)


def exit_code(returncode: int) -> int:
    """A child's return code as a shell reports it (killed by signal N: 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode
