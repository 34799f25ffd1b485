"""How many threads torch's intra-op pool (matmuls, attention, elementwise kernels on the CPU) uses
in each process: the cores this process may run on (its CPU affinity: a cgroup, taskset or a
scheduler's binding) shared by the processes of this machine (LOCAL_WORLD_SIZE, set by torchrun,
accelerate launch and tsp-launch; 1 for a plain tsp-train), at least 1. Ranks that together ask for
more threads than cores run several times slower: their OpenMP threads wait on each other's
descheduled peers at every parallel region.

The user's OMP_NUM_THREADS wins. tsp-launch puts the same rule's value into OMP_NUM_THREADS for
its ranks (torch elastic would otherwise set 1 and print a banner about it) and says so in
THREADS_FROM_LAUNCHER, so a rank can tell the launcher's value from the user's.

    line = set_intra_op_threads()       # one line for rank 0 to log
"""

from __future__ import annotations

import os

THREADS_FROM_LAUNCHER = "TSP_OMP_NUM_THREADS_FROM_LAUNCHER"


def owned_cores() -> int:
    """The CPUs this process may run on (its affinity; the machine's count where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):          # not Linux
        return os.cpu_count() or 1


def threads_per_process(cores: int, local_processes: int) -> int:
    return max(1, cores // max(1, local_processes))


def user_threads(environ) -> str | None:
    """OMP_NUM_THREADS as the user set it (None when unset, or set by tsp-launch)."""
    if environ.get(THREADS_FROM_LAUNCHER) == environ.get("OMP_NUM_THREADS"):
        return None
    return environ.get("OMP_NUM_THREADS")


def set_intra_op_threads(environ=os.environ) -> str:
    """Set torch's intra-op threads by the rule above; the line that says what and why."""
    import torch

    given = user_threads(environ)
    if given is not None:
        return f"threads: {torch.get_num_threads()} per process (OMP_NUM_THREADS={given}, as set)"
    cores, local = owned_cores(), int(environ.get("LOCAL_WORLD_SIZE") or 1)
    threads = threads_per_process(cores, local)
    torch.set_num_threads(threads)
    return (f"threads: {threads} per process ({cores} cores this process may use / {local} process(es) "
            "on this machine; OMP_NUM_THREADS overrides)")


def launcher_thread_env(local_processes: int, environ=os.environ) -> dict[str, str]:
    """tsp-launch: OMP_NUM_THREADS for its ranks by the rule, unless the user set one."""
    if "OMP_NUM_THREADS" in environ:
        return {}
    threads = str(threads_per_process(owned_cores(), local_processes))
    return {"OMP_NUM_THREADS": threads, THREADS_FROM_LAUNCHER: threads}
