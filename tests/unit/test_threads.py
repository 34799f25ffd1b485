"""Each process sets torch's intra-op threads to the cores it may use shared by the processes of
its machine (run/threads.py), unless the user set OMP_NUM_THREADS; tsp-launch hands its ranks the
same count through OMP_NUM_THREADS, marked as its own."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tsp_trainer.run.threads import (THREADS_FROM_LAUNCHER, launcher_thread_env, owned_cores,
                                     threads_per_process, user_threads)

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("cores,local,threads", [(2, 1, 2), (2, 4, 1), (64, 8, 8), (6, 4, 1), (1, 1, 1)])
def test_cores_over_local_processes_at_least_one(cores, local, threads):
    assert threads_per_process(cores, local) == threads


def test_the_users_omp_num_threads_wins_and_the_launchers_does_not():
    assert user_threads({}) is None
    assert user_threads({"OMP_NUM_THREADS": "3"}) == "3"
    assert user_threads({"OMP_NUM_THREADS": "2", THREADS_FROM_LAUNCHER: "2"}) is None
    # a launcher flag (accelerate's --num_cpu_threads_per_process) that changed it is the user's
    assert user_threads({"OMP_NUM_THREADS": "5", THREADS_FROM_LAUNCHER: "2"}) == "5"
    assert launcher_thread_env(4, {"OMP_NUM_THREADS": "3"}) == {}
    given = launcher_thread_env(4, {})
    assert given == {"OMP_NUM_THREADS": str(max(1, owned_cores() // 4)),
                     THREADS_FROM_LAUNCHER: str(max(1, owned_cores() // 4))}


def _runtime_threads(*envs: dict) -> list[dict]:
    """torch's intra-op threads after tsp-train's runtime set-up, and its line, under each of
    `envs` in turn, in one fresh process (each set-up sets the count by the rule, whatever the
    previous one set; OMP_NUM_THREADS is read when torch starts, so it needs a process of its own)."""
    code = ("import json, os, sys, torch; from tsp_trainer import cli\n"
            "for env in json.loads(sys.argv[1]):\n"
            "    os.environ.pop('LOCAL_WORLD_SIZE', None); os.environ.update(env)\n"
            "    cli._prepare_runtime(0, 1, say_threads='tsp-train')\n"
            "    print(json.dumps({'threads': torch.get_num_threads()}), flush=True)")
    base = {k: v for k, v in os.environ.items()
            if k not in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE", THREADS_FROM_LAUNCHER)}
    omp = {k: v for env in envs for k, v in env.items() if k == "OMP_NUM_THREADS"}
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(envs)], capture_output=True, text=True,
                          cwd=REPO, env={**base, "PYTHONPATH": str(REPO), **omp}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 2 * len(envs), lines
    return [{**json.loads(lines[2 * i + 1]), "line": lines[2 * i]} for i in range(len(envs))]


def test_a_process_sets_its_count_by_the_rule_not_torchs_default():
    """torch's default is the machine's core count whatever shares it; a process that is one of
    two on the machine takes half (at least 1), a single one all it may use, and a user's
    OMP_NUM_THREADS stays."""
    cores = owned_cores()
    half, single, many = _runtime_threads({"LOCAL_WORLD_SIZE": "2"}, {}, {"LOCAL_WORLD_SIZE": str(4 * cores)})
    assert half["threads"] == max(1, cores // 2)
    assert half["line"] == (f"tsp-train: threads: {max(1, cores // 2)} per process ({cores} cores this "
                            "process may use / 2 process(es) on this machine; OMP_NUM_THREADS overrides)")
    assert single["threads"] == cores
    assert many["threads"] == 1
    (given,) = _runtime_threads({"OMP_NUM_THREADS": "1"})          # torch caps it at the cores
    assert given["threads"] == 1 and "OMP_NUM_THREADS=1, as set" in given["line"]
