"""The intra-op thread count a fresh process sets at tsp-train's runtime set-up (run/threads.py's
rule: the cores it may use shared by the processes of its machine, unless the user set
OMP_NUM_THREADS, which torch reads when it starts: a process of its own)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tsp_trainer.run.threads import THREADS_FROM_LAUNCHER, owned_cores

REPO = Path(__file__).resolve().parents[2]


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
