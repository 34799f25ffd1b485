"""launch/slurm_7b_128k_1024gpu.sbatch under a real SLURM (munged, slurmctld, slurmd on this
machine: tests/helpers/slurm_cluster.py), as its CPU twin: the same file, with the tiny recipe, one
node x 4 processes and no GPUs given as variables and sbatch options. One run folder lives
through all of it: SLURM's USR1 lead (scancel --signal=USR1 --batch) and a preemption
(scontrol requeue) each checkpoint and requeue the job, a SIGKILLed rank fails it, the
resubmission resumes from the last complete checkpoint; the losses equal an uninterrupted job's
bit for bit, under one W&B run. Skips with the reason where SLURM cannot run (not root, not
installed and not installable)."""

import json
import os
import shutil
import signal
import socket
import time
from pathlib import Path

import pytest

from tests.helpers.slurm_cluster import SlurmCluster, SlurmUnavailable

REPO = Path(__file__).resolve().parents[2]
SBATCH = "launch/slurm_7b_128k_1024gpu.sbatch"
STEPS = 24
# The twin: what differs from the 1,024-GPU job is these variables and the allocation.
TWIN_VARS = {"RECIPE": "recipes/tiny_cpu.yaml", "PROCS_PER_NODE": "4"}
TWIN_ALLOCATION = ["--nodes=1", "--gpus-per-node=0", "--cpus-per-task=4", "--time=30"]
OVERRIDES = [f"train.steps={STEPS}", "checkpoint.every=4", "data.seq_len=64", "optim.warmup_steps=1",
             "logging.progress_bar=false", "logging.wandb_mode=offline"]
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")

# Each SLURM job spends about 100 s starting on 2 loaded cores; (b)-(e) run five allocations.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    try:
        cluster = SlurmCluster.start(tmp_path_factory.mktemp("slurm"), cpus=4, kill_wait_s=60)
    except SlurmUnavailable as err:
        pytest.skip(f"no SLURM on this machine: {err}")
    yield cluster
    cluster.stop()
    shutil.rmtree(cluster.root, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def submit(cluster: SlurmCluster, out: Path, logs: Path) -> str:
    env = dict(cluster.env, **TWIN_VARS, MASTER_PORT=str(_free_port()), DS_ACCELERATOR="cpu",
               WANDB_MODE="offline", WANDB_SILENT="true")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
        env.pop(key, None)
    # append: a requeued job writes after what its earlier runs wrote (SLURM truncates by default)
    return cluster.sbatch([*TWIN_ALLOCATION, f"--output={logs}/job-%j.out", "--open-mode=append", SBATCH,
                           f"train.output_dir={out}", *OVERRIDES], env=env, cwd=REPO)


class Watch:
    """Polls `scontrol show job` and records each state change (with its Reason) and its time."""

    def __init__(self, cluster: SlurmCluster, job: str):
        self.cluster, self.job, self.states = cluster, job, []
        self.restarts = 0

    def poll(self) -> dict:
        info = self.cluster.job(self.job)
        state = (info.get("JobState", "GONE"), info.get("Reason", ""))
        if not self.states or self.states[-1][0] != state:
            self.states.append((state, time.monotonic()))
        self.restarts = int(info.get("Restarts", self.restarts))
        # A requeued job waits for its BeginTime (slurmctld holds it back a while): let it go
        # sooner, but not in the second of the requeue. slurmd refuses a batch credential created
        # no later than the second it revoked the job's previous one ("Killing non-startable batch
        # job: Job credential revoked", the job FAILED); SLURM's own hold exists to avoid that.
        if state[0] == "PENDING" and state[1] == "BeginTime":
            self.cluster.run(["scontrol", "update", f"JobId={self.job}", "StartTime=now+2"],
                             check=False)
        return info

    def until(self, done, timeout_s: float = 600, what: str = ""):
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.poll()
            value = done(info)
            if value:
                return value
            assert time.monotonic() < deadline, f"{what}: states {self.names()}"
            time.sleep(0.2)

    def names(self) -> list[str]:
        return [state if not reason or reason == "None" else f"{state}({reason})"
                for (state, reason), _ in self.states]


def logged_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def losses(out: Path) -> dict[int, tuple[float, float]]:
    """step -> (loss, gradient norm), the last record of each step (a resume rewrites the steps
    after its checkpoint)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: (row["train/loss"], row["train/grad_norm"]) for row in rows
            if "train/loss" in row}


def latest_step(out: Path) -> int:
    return int((out / "checkpoints" / "latest").read_text().strip().split("_")[1])


@pytest.fixture(scope="module")
def uninterrupted(cluster, tmp_path_factory):
    """(a) The job trains to the end and exits 0; its losses are the reference."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    out = tmp / "run"
    job = submit(cluster, out, tmp)
    watch = Watch(cluster, job)
    info = watch.until(lambda i: i if i.get("JobState") in ENDED else None, what="uninterrupted job")
    log = (tmp / f"job-{job}.out").read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log[-3000:]
    assert f"tsp-train: done: {STEPS} steps" in log
    print(f"\nuninterrupted job {job}: states {' -> '.join(watch.names())}")
    return losses(out)


def test_the_job_trains_to_the_end_and_exits_0(uninterrupted):
    assert sorted(uninterrupted) == list(range(1, STEPS + 1))


def _wait_for_step(watch: Watch, out: Path, step: int, what: str) -> int:
    return watch.until(lambda i: (logged_steps(out) or [0])[-1] >= step and logged_steps(out)[-1],
                       what=what)


def _stop_and_requeue(watch: Watch, out: Path, log: Path, after: int, send, how: str) -> dict:
    """Wait for step `after`, `send()` the signal, wait for the job to leave RUNNING and run again;
    the figures of that stop."""
    k = _wait_for_step(watch, out, after, f"step {after} before {how}")
    restarts, ranks = watch.restarts, _rank_pids(watch.cluster, watch.job)
    send()
    seconds = _until_gone(ranks)
    watch.until(lambda i: watch.restarts > restarts and i.get("JobState") == "RUNNING",
                what=f"job running again after {how}")
    saved = latest_step(out)
    text = log.read_text()
    assert f"tsp-train: stopped after step {saved} of {STEPS}" in text, text[-3000:]
    assert saved >= k, (k, saved)                      # nothing logged is lost
    return {"how": how, "step_logged_at_signal": k, "checkpoint": saved, "steps_lost": 0,
            "signal_to_ranks_gone_s": round(seconds, 1)}


def _until_gone(pids: list[int], timeout_s: float = 300) -> float:
    """Seconds until none of `pids` runs."""
    t0 = time.monotonic()
    while any(_alive(pid) for pid in pids):
        assert time.monotonic() - t0 < timeout_s, pids
        time.sleep(0.05)
    return time.monotonic() - t0


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _rank_pids(cluster: SlurmCluster, job: str) -> list[int]:
    """PIDs of the job's trainer ranks (`python -m tsp_trainer train ...`, not the launchers)."""
    pids = []
    for line in cluster.run(["scontrol", "listpids", job]).stdout.splitlines()[1:]:
        pid = int(line.split()[0])
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"tsp_trainer" in cmd and b"train" in cmd and not any(b"tsp-launch" in c for c in cmd):
            pids.append(pid)
    return pids


def test_preemption_requeue_kill_and_resubmit_keep_one_exact_run(cluster, uninterrupted,
                                                                  tmp_path):
    """(b) USR1 to the batch shell: checkpoint at the next step, exit 75, the script requeues,
    the requeued job resumes (train.resume=auto). (c) scontrol requeue (SIGTERM to every process
    of the job): the same, requeued by SLURM. (d) a rank SIGKILLed: the job FAILED, the
    resubmission resumes from the last complete checkpoint and finishes. (e) one W&B run id
    throughout; the losses equal the uninterrupted job's bit for bit."""
    out, log_dir = tmp_path / "run", tmp_path
    job = submit(cluster, out, log_dir)
    log = log_dir / f"job-{job}.out"
    watch = Watch(cluster, job)
    figures = [_stop_and_requeue(watch, out, log, 3, lambda: cluster.run(
        ["scancel", "--signal=USR1", "--batch", job]), "scancel --signal=USR1 --batch")]
    assert "caught USR1" in log.read_text()
    run_id = json.loads((out / "run.json").read_text())["wandb_run_id"]

    resumed_at = figures[-1]["checkpoint"]
    figures.append(_stop_and_requeue(watch, out, log, resumed_at + 3, lambda: cluster.run(
        ["scontrol", "requeue", job]), "scontrol requeue"))
    text = log.read_text()
    assert f"resumed from {out / 'checkpoints'}/step_{resumed_at:08d} at step {resumed_at}" in text

    resumed_at = figures[-1]["checkpoint"]
    k = _wait_for_step(watch, out, resumed_at + 6, "steps before the SIGKILL")
    victim = _rank_pids(cluster, job)
    assert len(victim) == 4, victim
    before = latest_step(out)
    os.kill(victim[-1], signal.SIGKILL)
    kill_s = _until_gone(victim)
    info = watch.until(lambda i: i if i.get("JobState") in ENDED else None, what="job after SIGKILL")
    assert info["JobState"] == "FAILED" and info["ExitCode"] != "0:0", info
    last_complete = latest_step(out)              # a periodic save may have finished meanwhile
    assert before <= last_complete <= k + 1, (before, last_complete, k)
    states = watch.names()

    again = submit(cluster, out, log_dir)
    rewatch = Watch(cluster, again)
    info = rewatch.until(lambda i: i if i.get("JobState") in ENDED else None, what="resubmission")
    text = (log_dir / f"job-{again}.out").read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), text[-3000:]
    assert (f"resumed from {out / 'checkpoints'}/step_{last_complete:08d} at step {last_complete}"
            in text), text[-3000:]
    figures.append({"how": "SIGKILL of one rank", "step_logged_at_signal": k,
                    "checkpoint": last_complete, "steps_lost": max(0, k - last_complete),
                    "signal_to_ranks_gone_s": round(kill_s, 1)})

    assert losses(out) == uninterrupted                      # bit for bit: floats compared exactly
    assert json.loads((out / "run.json").read_text())["wandb_run_id"] == run_id
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 4 and all(r.name.endswith(run_id) for r in runs), runs
    print(f"\njob {job}: states {' -> '.join(states)}; resubmitted as {again}: "
          f"{' -> '.join(rewatch.names())}")
    for row in figures:
        print(json.dumps(row))
