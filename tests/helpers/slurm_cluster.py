"""A real SLURM on this machine: munged, slurmctld and one slurmd (node n1), all state in one
temporary folder, each daemon stopped by its PID.

    with SlurmCluster.start(tmp, cpus=4) as cluster:   # SlurmUnavailable: why this machine cannot
        job = cluster.sbatch(["--nodes=1", script])
        cluster.job(job)["JobState"]                    # scontrol show job, as a dict
        cluster.env                                     # SLURM_CONF for sbatch / squeue / scontrol

By hand (prints the environment to use, stops everything on Ctrl-C):

    python -m tests.helpers.slurm_cluster [--install] [--cpus 4]

One node: several slurmd on one host (`--nodes 2`: n1, n2 on their own ports and spools) start and
take jobs, but Debian's slurmd is built without --enable-multiple-slurmd, so every task of a step
learns node id 0 and the hostname's node name (SLURM_NODEID and SLURM_PROCID are 0 on both nodes):
a multi-node launch on them would start two machine-rank-0 launchers.

Needs root (slurmd runs jobs as their user; munged and the daemons run as root here) and the
Debian packages slurmctld slurmd slurm-client munge (`--install`, or `ensure_installed()`, runs
apt-get when they are missing). No cgroups (proctrack/linuxproc, task/none), no accounting
daemon: a job's states are read from `scontrol show job` while it runs and from the job
completion log (jobcomp/filetxt) once it ended.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel")
APT_PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")


class SlurmUnavailable(RuntimeError):
    """This machine cannot run SLURM (the reason is the message)."""


def missing_binaries() -> list[str]:
    return [name for name in DAEMONS if shutil.which(name, path=_sbin_path()) is None]


def ensure_installed(install: bool = True) -> None:
    """The SLURM and munge binaries, from apt when missing and `install` (root only)."""
    if not missing_binaries():
        return
    if not install or os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise SlurmUnavailable(f"SLURM binaries missing ({', '.join(missing_binaries())}); "
                               f"install as root: apt-get install -y {' '.join(APT_PACKAGES)}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-q", "--no-install-recommends", *APT_PACKAGES]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SlurmUnavailable(f"{' '.join(cmd)} failed: {done.stderr.strip()[-300:]}")
    if missing_binaries():
        raise SlurmUnavailable(f"still missing after apt-get: {', '.join(missing_binaries())}")


def _sbin_path() -> str:
    return os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def slurm_conf(root: Path, *, nodes: int, cpus: int, ctld_port: int, node_ports: list[int],
               munge_socket: Path, kill_wait_s: int) -> str:
    """A minimal slurm.conf: one host, `nodes` slurmd on their own ports, a CPU partition."""
    host = socket.gethostname()
    lines = [
        "ClusterName=tsp-local",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={munge_socket}",
        f"StateSaveLocation={root}/ctld",
        f"SlurmdSpoolDir={root}/spool/%n",
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd.%n.pid",
        f"SlurmctldLogFile={root}/log/slurmctld.log",
        f"SlurmdLogFile={root}/log/slurmd.%n.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/filetxt",
        f"JobCompLoc={root}/jobcomp.log",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SchedulerType=sched/builtin",
        "MpiDefault=none",
        "ReturnToService=2",
        "SlurmdTimeout=60",
        "InactiveLimit=0",
        "MinJobAge=600",
        f"KillWait={kill_wait_s}",
        "Waittime=0",
        "MessageTimeout=30",
        "SwitchType=switch/none",
        "SlurmdParameters=config_overrides",   # CPUs= as written, whatever this machine has
    ]
    for i, port in enumerate(node_ports, start=1):
        lines.append(f"NodeName=n{i} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} "
                     f"CPUs={cpus} RealMemory=1000 State=UNKNOWN")
    names = f"n[1-{nodes}]" if nodes > 1 else "n1"
    lines.append(f"PartitionName=cpu Nodes={names} Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


@dataclass
class SlurmCluster:
    root: Path
    nodes: int
    pids: dict[str, int] = field(default_factory=dict)     # daemon name -> pid
    _procs: dict[str, subprocess.Popen] = field(default_factory=dict, repr=False)

    @property
    def env(self) -> dict[str, str]:
        return dict(os.environ, SLURM_CONF=str(self.root / "slurm.conf"),
                    PATH=_sbin_path())

    @classmethod
    def start(cls, root: str | os.PathLike | None = None, *, nodes: int = 1, cpus: int = 4,
              kill_wait_s: int = 30, install: bool = True, ready_s: float = 60.0) -> SlurmCluster:
        if os.geteuid() != 0:
            raise SlurmUnavailable("needs root (slurmd starts jobs as their user)")
        ensure_installed(install)
        root = Path(root or tempfile.mkdtemp(prefix="tsp_slurm_"))
        for sub in ("ctld", "log", "munge", *(f"spool/n{i}" for i in range(1, nodes + 1))):
            (root / sub).mkdir(parents=True, exist_ok=True)
        cluster = cls(root=root, nodes=nodes)
        try:
            cluster._start_munge()
            ctld_port, *node_ports = _free_ports(1 + nodes)
            (root / "slurm.conf").write_text(slurm_conf(
                root, nodes=nodes, cpus=cpus, ctld_port=ctld_port, node_ports=node_ports,
                munge_socket=root / "munge" / "munge.socket", kill_wait_s=kill_wait_s))
            cluster._daemon("slurmctld", ["slurmctld", "-D", "-i"])
            for i in range(1, nodes + 1):
                cluster._daemon(f"slurmd.n{i}", ["slurmd", "-D", "-N", f"n{i}"])
            cluster._wait_idle(ready_s)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _start_munge(self) -> None:
        key = self.root / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(128))
        key.chmod(0o600)
        self.root.chmod(0o755)
        (self.root / "munge").chmod(0o700)
        self._daemon("munged", ["munged", "-F", "--force", f"--key-file={key}",
                                f"--socket={self.root / 'munge' / 'munge.socket'}",
                                f"--pid-file={self.root / 'munge' / 'munged.pid'}",
                                f"--seed-file={self.root / 'munge' / 'munged.seed'}",
                                f"--log-file={self.root / 'log' / 'munged.log'}"])
        deadline = time.monotonic() + 20
        while not (self.root / "munge" / "munge.socket").exists():
            self._check_alive("munged")
            if time.monotonic() > deadline:
                raise SlurmUnavailable("munged did not create its socket in 20 s")
            time.sleep(0.1)

    def _daemon(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab")
        exe = shutil.which(cmd[0], path=_sbin_path())
        proc = subprocess.Popen([exe, *cmd[1:]], env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        log.close()
        self.pids[name] = proc.pid
        self._procs[name] = proc

    def _check_alive(self, name: str) -> None:
        proc = self._procs[name]
        if proc.poll() is not None:
            out = (self.root / "log" / f"{name}.out").read_text(errors="replace")[-800:]
            raise SlurmUnavailable(f"{name} exited with {proc.returncode}: {out.strip()}")

    def _wait_idle(self, ready_s: float) -> None:
        deadline = time.monotonic() + ready_s
        while True:
            for name in self.pids:
                self._check_alive(name)
            out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout.split()
            states = dict(zip(out[::2], out[1::2]))
            if len(states) == self.nodes and all(s == "idle" for s in states.values()):
                return
            if time.monotonic() > deadline:
                raise SlurmUnavailable(f"nodes not idle after {ready_s:.0f} s: {states}")
            time.sleep(0.5)

    # -- using it ---------------------------------------------------------------------------------
    def run(self, cmd: list[str], *, check: bool = True, **kw) -> subprocess.CompletedProcess:
        done = subprocess.run(cmd, env=kw.pop("env", self.env), capture_output=True, text=True,
                              timeout=kw.pop("timeout", 60), **kw)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: exit {done.returncode}: {done.stderr.strip()}")
        return done

    def sbatch(self, args: list[str], **kw) -> str:
        """Submit; the job id."""
        out = self.run(["sbatch", "--parsable", *args], **kw).stdout.strip()
        return out.split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict ({} once the job left slurmctld's memory)."""
        done = self.run(["scontrol", "show", "job", "-o", job_id], check=False)
        return dict(re.findall(r"(\w+)=(\S*)", done.stdout)) if done.returncode == 0 else {}

    def stop(self) -> None:
        """Cancel this cluster's jobs, SIGTERM each daemon it started, by PID (slurmd first, munged
        last; SIGKILL after 10 s), then SIGKILL what outlived them: slurmstepd detaches from
        slurmd, and it and the job's processes carry this cluster's SLURM_CONF in their
        environment. The state folder stays for the caller to remove."""
        if "slurmctld" in self.pids:
            self._cancel_jobs()
        order = [n for n in self.pids if n.startswith("slurmd")] + \
                [n for n in ("slurmctld", "munged") if n in self.pids]
        for name in order:
            proc = self._procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        self.pids.clear()
        for pid in self._leftover_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _cancel_jobs(self, wait_s: float = 30.0) -> None:
        jobs = self.run(["squeue", "-h", "-o", "%i"], check=False).stdout.split()
        if jobs:
            self.run(["scancel", *jobs], check=False)
        deadline = time.monotonic() + wait_s
        while jobs and time.monotonic() < deadline:
            time.sleep(0.5)
            jobs = self.run(["squeue", "-h", "-o", "%i"], check=False).stdout.split()

    def _leftover_pids(self) -> list[int]:
        """Processes whose environment names this cluster's slurm.conf (not this process)."""
        mark = f"SLURM_CONF={self.root / 'slurm.conf'}".encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if mark in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:
                continue
        return pids

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--install", action="store_true", help="apt-get install what is missing")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--cpus", type=int, default=4, help="CPUs each node offers")
    args = parser.parse_args(argv)
    cluster = SlurmCluster.start(nodes=args.nodes, cpus=args.cpus, install=args.install)
    print(f"SLURM up: {args.nodes} node(s), state in {cluster.root}\n"
          f"  export SLURM_CONF={cluster.root / 'slurm.conf'}\n"
          f"  sbatch ...; squeue; scontrol show job ID        (Ctrl-C stops every daemon)", flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
        shutil.rmtree(cluster.root, ignore_errors=True)


if __name__ == "__main__":
    main()
