"""`launch/torchrun.sh` runs a short variant of recipes/tiny_cpu.yaml (the plain `accelerate
launch` line of its comment runs, stopped, resumed and to the end with the loss falling, in
test_interrupt_launch.py). Subprocesses, like a user would run them. The launch
scripts' command lines (torchrun.sh on one CPU node and on 128 GPU nodes, the SLURM batch script
and its USR1 requeue) run against stand-ins for python, srun, scontrol and tsp-launch that record their argv."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _env():
    env = dict(os.environ, DS_ACCELERATOR="cpu", WANDB_MODE="disabled")
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)
    return env


@pytest.mark.slow           # a 2-process torchrun run (~12 s); its command lines run below
def test_torchrun_script_and_bad_recipe_message(tmp_path):
    env = dict(_env(), NPROC="2", MASTER_PORT="0", PYTHON=sys.executable)
    # the bad recipe's tsp-train beside the run (it stops before anything is written)
    bad = subprocess.Popen([str(BIN / "tsp-train"), "recipes/tiny_cpu.yaml", "train.stpes=3"], cwd=REPO,
                           env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc = subprocess.run(["bash", "launch/torchrun.sh", "recipes/tiny_cpu.yaml", "train.steps=6",
                           "optim.warmup_steps=2", "data.seq_len=64", "checkpoint.every=0",
                           "train.eval_every=0", f"train.output_dir={tmp_path / 'tr'}",
                           "logging.progress_bar=false"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    _, bad_err = bad.communicate(timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "tsp-train: done: 6 steps" in proc.stdout
    assert bad.returncode == 2
    assert "train.stpes" in bad_err and "train.steps" in bad_err
    assert not (REPO / "runs" / "default").exists()


# ---- the launch scripts' command lines, with stand-ins that record their argv -----------------

# A stand-in for python / tsp-launch / srun / scontrol: appends {"prog", "argv", "env"} to
# $STANDIN_LOG. As python it answers the CUDA probe (`python -c ...`) with $STANDIN_CUDA (0: yes);
# as srun it runs its command (the arguments after srun's own leading --options) as node 0 of 128
# and forwards SIGTERM to it; as scancel it sends SIGTERM to that srun (the job's step); as
# scontrol it prints 128 host names; as tsp-launch it waits for a signal when $STANDIN_WAIT is set.
_STANDIN = """#!{python}
import json, os, signal, subprocess, sys, time
prog, argv = os.path.basename(sys.argv[0]), sys.argv[1:]
if not (prog == "python" and argv[:1] == ["-c"]):
    env = {{k: os.environ.get(k) for k in ("DS_ACCELERATOR", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
                                        "MASTER_ADDR", "MASTER_PORT")}}
    with open(os.environ["STANDIN_LOG"], "a") as log:
        log.write(json.dumps({{"prog": prog, "argv": argv, "env": env}}) + "\\n")
if prog == "python" and argv[:1] == ["-c"]:
    sys.exit(int(os.environ["STANDIN_CUDA"]))
if prog == "srun":
    first = next(i for i, a in enumerate(argv) if not a.startswith("--"))
    command = argv[first:]
    task = subprocess.Popen(command, env=dict(os.environ, SLURM_NNODES="128", SLURM_NODEID="0"))
    with open(os.environ["STANDIN_LOG"] + ".srun", "w") as pid:
        pid.write(str(os.getpid()))
    signal.signal(signal.SIGTERM, lambda *_: task.terminate())     # srun forwards it to its tasks
    sys.exit(task.wait())
if prog == "scancel":
    os.kill(int(open(os.environ["STANDIN_LOG"] + ".srun").read()), signal.SIGTERM)
if prog == "scontrol" and argv[:2] == ["show", "hostnames"]:
    sys.stdout.write("".join(f"gpu-node-{{i:03d}}\\n" for i in range(1, 129)))
if prog == "tsp-launch" and os.environ.get("STANDIN_WAIT"):
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    time.sleep(60)
"""


def _standins(tmp_path: Path, *progs: str) -> Path:
    folder = tmp_path / "bin"
    folder.mkdir(exist_ok=True)
    for prog in progs:
        path = folder / prog
        path.write_text(_STANDIN.format(python=sys.executable))
        path.chmod(0o755)
    return folder


def _calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _script_env(tmp_path: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("DS_ACCELERATOR", "MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "NPROC",
                        "RDZV_ID", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "RECIPE", "REPO",
                        "PROCS_PER_NODE", "ACCELERATE_CONFIG")}
    return dict(env, STANDIN_LOG=str(tmp_path / "calls.jsonl"), **extra)


def _torchrun_line(nnodes, node_rank, nproc, endpoint, *rest):
    return ["-m", "torch.distributed.run", "--nnodes", nnodes, "--node_rank", node_rank,
            "--nproc_per_node", nproc, "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint,
            "--rdzv_id", "tsp_trainer", "-m", "tsp_trainer", "train", *rest]


@pytest.mark.parametrize("extra,cuda,line,accelerator", [
    ({}, "1", _torchrun_line("1", "0", "4", "127.0.0.1:0", "recipes/tiny_cpu.yaml", "train.steps=10"),
     "cpu"),
    ({"NNODES": "128", "NODE_RANK": "5", "MASTER_ADDR": "host0", "NPROC": "8"}, "0",
     _torchrun_line("128", "5", "8", "host0:29500", "recipes/tiny_cpu.yaml", "train.steps=10"), None),
], ids=["one-cpu-node", "128-gpu-nodes"])
def test_torchrun_script_command_line(tmp_path, extra, cuda, line, accelerator):
    """launch/torchrun.sh: first the input check at the job's world size (NNODES x NPROC) as the
    node's first rank (NODE_RANK x NPROC), then
    torchrun with 4 processes on one node with a free port by default, the given node count, rank,
    endpoint and processes otherwise; DeepSpeed on CPU only where CUDA is absent; the recipe and
    the overrides passed through to both."""
    python = _standins(tmp_path, "python") / "python"
    env = _script_env(tmp_path, PYTHON=str(python), STANDIN_CUDA=cuda, **extra)
    proc = subprocess.run(["bash", "launch/torchrun.sh", "recipes/tiny_cpu.yaml", "train.steps=10"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    check, call = _calls(tmp_path / "calls.jsonl")
    nproc = int(extra.get("NPROC", "4"))
    world, first = str(int(extra.get("NNODES", "1")) * nproc), str(int(extra.get("NODE_RANK", "0")) * nproc)
    assert (check["prog"], check["argv"]) == ("python", ["-m", "tsp_trainer", "check", "--world-size",
                                                          world, "--first-rank", first,
                                                          "recipes/tiny_cpu.yaml", "train.steps=10"])
    assert (call["prog"], call["argv"]) == ("python", line)
    assert call["env"]["DS_ACCELERATOR"] == accelerator
    assert (REPO / "recipes/tiny_cpu.yaml").exists()


def test_torchrun_script_without_recipe_prints_usage(tmp_path):
    proc = subprocess.run(["bash", "launch/torchrun.sh"], cwd=REPO, env=_script_env(tmp_path),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "usage: launch/torchrun.sh RECIPE [key=value ...]" in proc.stderr
    assert _calls(tmp_path / "calls.jsonl") == []


SBATCH = "launch/slurm_7b_128k_1024gpu.sbatch"


def _sbatch_env(tmp_path: Path, **extra: str) -> dict:
    """srun and scontrol stand-ins on PATH; REPO a scratch folder whose .venv/bin/tsp-launch is the
    tsp-launch stand-in (the script runs `$REPO/.venv/bin/tsp-launch` and writes logs/ there)."""
    bin_dir = _standins(tmp_path, "srun", "scancel", "scontrol", "tsp-launch")
    repo = tmp_path / "repo"
    (repo / ".venv" / "bin").mkdir(parents=True)
    (repo / ".venv" / "bin" / "tsp-launch").symlink_to(bin_dir / "tsp-launch")
    return _script_env(tmp_path, PATH=f"{bin_dir}:{os.environ['PATH']}", REPO=str(repo),
                       SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="gpu-node-[001-128]", SLURM_NNODES="128",
                       **extra)


SBATCH_LAUNCH = ["--machine_rank", "0", "--config_file", "launch/accelerate/gpu_multinode.yaml",
                 "--num_machines", "128", "--num_processes", "1024",
                 "--main_process_ip", "gpu-node-001", "--main_process_port", "29500",
                 "recipes/7b_128k_1024gpu.yaml", "train.resume=auto"]


def test_sbatch_command_line(tmp_path):
    """One srun launcher per node; each runs tsp-launch with the multinode config for 8 processes
    of 1,024, the first of 128 hosts as the rendezvous (read without a pipe that SIGPIPE would
    fail under pipefail), and the 7B recipe resuming from its newest checkpoint; the launcher's
    shutdown grace (240 s) fits inside SLURM's 300 s signal lead."""
    proc = subprocess.run(["bash", SBATCH], cwd=REPO, env=_sbatch_env(tmp_path), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    calls = _calls(tmp_path / "calls.jsonl")
    assert [(c["prog"], c["argv"][:2]) for c in calls] == [
        ("scontrol", ["show", "hostnames"]), ("srun", ["--kill-on-bad-exit=1", "bash"]),
        ("tsp-launch", SBATCH_LAUNCH[:2])]
    launcher = calls[2]
    assert launcher["argv"] == SBATCH_LAUNCH
    assert launcher["env"]["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "240"
    assert "#SBATCH --signal=B:USR1@300" in (REPO / SBATCH).read_text()
    for path in ("launch/accelerate/gpu_multinode.yaml", "recipes/7b_128k_1024gpu.yaml"):
        assert (REPO / path).exists(), path


def test_sbatch_twin_differs_only_in_its_variables(tmp_path):
    """The CPU twin the SLURM tests run (tests/integration/test_slurm_cluster.py): the same script
    with RECIPE, PROCS_PER_NODE and ACCELERATE_CONFIG set and overrides after the script name;
    MASTER_ADDR given wins over the first host."""
    env = _sbatch_env(tmp_path, RECIPE="recipes/tiny_cpu.yaml", PROCS_PER_NODE="4",
                      ACCELERATE_CONFIG="launch/accelerate/cpu_4proc.yaml", MASTER_ADDR="10.0.0.9")
    proc = subprocess.run(["bash", SBATCH, "train.steps=8"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    launcher = [c for c in _calls(tmp_path / "calls.jsonl") if c["prog"] == "tsp-launch"][0]
    assert launcher["argv"] == ["--machine_rank", "0", "--config_file", "launch/accelerate/cpu_4proc.yaml",
                                "--num_machines", "128", "--num_processes", "512",
                                "--main_process_ip", "10.0.0.9", "--main_process_port", "29500",
                                "recipes/tiny_cpu.yaml", "train.resume=auto", "train.steps=8"]


def test_sbatch_usr1_stops_the_launcher_and_requeues(tmp_path):
    """SLURM's USR1 before the time limit: the batch shell has SLURM send SIGTERM to the job's
    steps (scancel --signal=TERM; here: to the srun stand-in, which passes it to the launcher
    stand-in), waits for srun, requeues the job and exits 0."""
    log = tmp_path / "calls.jsonl"
    proc = subprocess.Popen(["bash", SBATCH], cwd=REPO, env=_sbatch_env(tmp_path, STANDIN_WAIT="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 30
    while not any(c["prog"] == "tsp-launch" for c in _calls(log)) and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "caught USR1: asking the trainer to checkpoint and stop (job 4242)" in out
    assert "requeueing job 4242" in out
    assert [c["argv"] for c in _calls(log) if c["prog"] == "scancel"] == [["--signal=TERM", "4242"]]
    assert [c["argv"] for c in _calls(log) if c["prog"] == "scontrol"][-1] == ["requeue", "4242"]
