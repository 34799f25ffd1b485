"""Two launchers on one machine as the two nodes of one job, without a scheduler: `tsp-launch`,
plain `accelerate launch -m tsp_trainer train` and `launch/torchrun.sh`, each started twice (node
ranks 0 and 1, 2 processes each) with the rendezvous on a free loopback port. The start-up's
placement line shows each TSP group inside one launcher and the DP groups across both; the losses
equal one launcher's 4 processes; SIGKILL of one launcher's process group ends the other within
train.collective_timeout_s plus a margin, the first surviving rank to fail naming the lost node in
one line.

Each test starts 4 ranks in two launchers: slow. The launchers' runs are pairwise: tsp-launch and
torchrun train to the end; accelerate launch and torchrun lose a node."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.test_tsp_launch import TSP_LAUNCH

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
CONFIG = "launch/accelerate/cpu_4proc.yaml"
RECIPE = "recipes/tiny_cpu.yaml"
TIMEOUT_S = 30             # train.collective_timeout_s of these runs
RUN = ["data.seq_len=64", "optim.warmup_steps=1", "optim.min_lr=3.0e-3", "checkpoint.every=0",
       "train.eval_every=0", "logging.progress_bar=false", f"train.collective_timeout_s={TIMEOUT_S}"]

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict:
    env = dict(os.environ, DS_ACCELERATOR="cpu", WANDB_MODE="disabled", PYTHON=sys.executable,
               PYTHONPATH=str(REPO), **extra)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NNODES",
                "NODE_RANK", "NPROC", "GROUP_RANK", "SLURM_NODEID", "SLURM_NTASKS", "SLURM_JOB_ID"):
        if key not in extra:
            env.pop(key, None)
    return env


def accelerate_flags(node: int, port: int) -> list[str]:
    return ["--config_file", CONFIG, "--num_machines", "2", "--num_processes", "4",
            "--machine_rank", str(node), "--main_process_ip", "127.0.0.1",
            "--main_process_port", str(port)]


def launcher_command(launcher: str, node: int, port: int, args: list[str]) -> tuple[list[str], dict]:
    """The command line and environment of node `node`'s launcher (of 2, 2 processes each)."""
    if launcher == "tsp-launch":
        return TSP_LAUNCH + accelerate_flags(node, port) + [RECIPE, *args], _env()
    if launcher == "accelerate":
        return ([str(BIN / "accelerate"), "launch", *accelerate_flags(node, port), "-m", "tsp_trainer",
                 "train", RECIPE, *args], _env())
    return (["bash", "launch/torchrun.sh", RECIPE, *args],
            _env(NNODES="2", NODE_RANK=str(node), NPROC="2", MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port)))


def start_two(launcher: str, args: list[str]) -> list[subprocess.Popen]:
    """Node 0's and node 1's launchers, each the leader of its own process group (as on two hosts,
    a kill of one group reaches none of the other's processes)."""
    port, procs = free_port(), []
    for node in (0, 1):
        cmd, env = launcher_command(launcher, node, port, args)
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, text=True, start_new_session=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    return procs


def finish(procs: list[subprocess.Popen], timeout: float = 600) -> list[tuple[int, str, str]]:
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        results.append((proc.returncode, out, err))
    return results


def losses(out: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows}


def placement(log: str) -> dict:
    """Rank 0's start-up placement line: {"nodes": {node: ranks}, "tsp": [...], "dp": [...],
    "tsp_local": bool, "dp_nodes": [...]}."""
    line = next(x for x in log.splitlines() if "] placement: " in x)
    nodes = {int(n): json.loads(r) for n, r in re.findall(r"node (\d+) \(host [^)]*\): ranks (\[[\d, ]*\])", line)}
    tsp = re.search(r"tsp groups (\[\[.*?\]\])", line)
    dp = re.search(r"dp groups (\[\[.*?\]\]) across nodes (\[[\d, ]*\])", line)
    return {"nodes": nodes, "tsp": json.loads(tsp.group(1)), "tsp_local": "each in one node" in line,
            "dp": json.loads(dp.group(1)), "dp_nodes": json.loads(dp.group(2))}


@pytest.fixture(scope="module")
def one_launcher_losses(tmp_path_factory) -> dict[int, float]:
    """The same training from one launcher of 4 processes."""
    out = tmp_path_factory.mktemp("one_launcher")
    proc = subprocess.run([str(BIN / "accelerate"), "launch", "--config_file", CONFIG, "-m", "tsp_trainer",
                           "train", RECIPE, "train.steps=3", f"train.output_dir={out}", *RUN],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert placement(proc.stderr)["nodes"] == {0: [0, 1, 2, 3]}
    return losses(out)


def _placed_as_one_job(rank_0_log: str) -> None:
    """TSP groups node-local (one launcher's ranks), DP across the launchers."""
    where = placement(rank_0_log)
    assert where["nodes"] == {0: [0, 1], 1: [2, 3]}
    assert where["tsp"] == [[0, 1], [2, 3]] and where["tsp_local"]
    assert where["dp"] == [[0, 2], [1, 3]] and where["dp_nodes"] == [0, 1]


# accelerate launch is placed and trains as one job in the kill test below (tsp-launch runs it too)
@pytest.mark.parametrize("launcher", ["tsp-launch", "torchrun"])
def test_two_launchers_train_as_one(launcher, tmp_path, one_launcher_losses):
    """TSP groups node-local (one launcher's ranks), DP across the launchers, the losses of one
    launcher's run, exit 0 on both."""
    out = tmp_path / "run"
    results = finish(start_two(launcher, ["train.steps=3", f"train.output_dir={out}", *RUN]))
    for node, (code, _, err) in enumerate(results):
        assert code == 0, (node, err[-4000:])
    assert "tsp-train: done: 3 steps" in results[0][1]
    _placed_as_one_job(results[0][2])
    assert losses(out) == one_launcher_losses


def steps_logged(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.parametrize("launcher,victim", [("accelerate", 1), ("torchrun", 0)])
def test_killing_one_launcher_ends_the_other_naming_the_lost_node(launcher, victim, tmp_path,
                                                                  one_launcher_losses):
    """SIGKILL of one launcher's process group (what a dead node looks like to the other) after
    step 2: the other launcher exits non-zero within the collective timeout plus a margin; its
    first rank to fail says in one line which node (machine rank, host, ranks) it lost, and every
    other rank says the same or that a peer on its node left first. Until then
    the two trained as one job: placed as one, the steps logged are one launcher's (a constant
    rate: the same first steps as its 3-step run)."""
    out = tmp_path / "run"
    procs = start_two(launcher, ["train.steps=400", f"train.output_dir={out}", *RUN])
    deadline = time.monotonic() + 600
    while steps_logged(out) < 2:
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, finish(procs, 60)
        time.sleep(0.05)
    os.killpg(procs[victim].pid, signal.SIGKILL)
    t0 = time.monotonic()
    survivor = procs[1 - victim]
    code, _, err = finish([survivor], timeout=TIMEOUT_S + 60)[0]
    seconds = time.monotonic() - t0
    _, victim_err = procs[victim].communicate(timeout=30)
    print(f"\n{launcher}: node {1 - victim}'s launcher exited {code} {seconds:.1f} s after node "
          f"{victim}'s was killed")
    assert code != 0, err[-3000:]
    assert seconds < TIMEOUT_S + 30, seconds
    lost = f"lost contact with node {victim} (host {socket.gethostname()}, ranks {[2 * victim, 2 * victim + 1]})"
    lines = [x for x in err.splitlines() if x.startswith("tsp-train: error (rank ")]
    assert lines, err[-3000:]
    # the node's first rank to fail had a peer on the lost node; a local peer left waiting on it
    # in a node-local collective fails once it exits, and points to its line
    assert lost in lines[0], lines
    local = f"a peer on this node (node {1 - victim} (host {socket.gethostname()})) left first"
    assert all((lost in x or local in x) and f", node {1 - victim} (host " in x for x in lines), lines
    assert {int(x.split("(rank ")[1].split(",")[0]) for x in lines} <= {2 * (1 - victim), 2 * (1 - victim) + 1}
    _placed_as_one_job(victim_err if victim == 0 else err)          # rank 0's log: node 0's
    logged = losses(out)
    assert len(logged) >= 2
    assert {s: logged[s] for s in one_launcher_losses if s in logged} == \
        {s: one_launcher_losses[s] for s in one_launcher_losses if s in logged}
