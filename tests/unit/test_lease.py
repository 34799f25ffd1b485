"""The run folder's lease (tsp_trainer/run/lease.py): a live holder is refused with one line naming
it, a gone one is taken over with one warning line, and where flock is not supported (simulated:
flock raising ENOLCK) the lease file alone decides, by pid on this host and by heartbeat age for
another host."""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tsp_trainer.run import lease as lease_mod
from tsp_trainer.run.lease import (LEASE_FILE, Holder, LeaseHeld, RunLease, check_free,
                                   check_not_held_by_another_job, process_start_ticks)

REPO = Path(__file__).resolve().parents[2]
HOST = socket.gethostname()


def acquire(out, warnings=None, **kw):
    return RunLease.acquire(out, warn=(warnings if warnings is not None else []).append,
                            heartbeat_s=0, **kw)


def write_lease(out: Path, *, host=HOST, pid: int, started_ticks=None, job_id="4242",
                age_s: float = 0.0) -> Holder:
    holder = Holder(host=host, pid=pid, started_ticks=started_ticks, job_id=job_id,
                    rendezvous="10.0.0.1:29500", since="2026-01-02T03:04:05Z")
    out.mkdir(parents=True, exist_ok=True)
    path = out / LEASE_FILE
    path.write_text(json.dumps(dataclasses.asdict(holder)))
    if age_s:
        os.utime(path, (time.time() - age_s, time.time() - age_s))
    return holder


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def no_flock(monkeypatch):
    def unsupported(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lease_mod.fcntl, "flock", unsupported)


def test_second_lease_in_one_process_is_refused_and_release_frees_the_folder(tmp_path):
    out = tmp_path / "run"
    first = acquire(out)
    with pytest.raises(LeaseHeld, match=f"pid {os.getpid()}, no job id"):
        acquire(out)
    first.release()
    assert not (out / LEASE_FILE).exists()
    first.release()                                   # idempotent
    warnings = []
    acquire(out, warnings).release()
    assert warnings == []                             # a released lease leaves nothing stale


def test_stale_lease_file_of_a_dead_pid_is_taken_over_with_one_warning(tmp_path):
    out = tmp_path / "run"
    pid = dead_pid()
    write_lease(out, pid=pid)
    warnings = []
    lease = acquire(out, warnings)
    assert warnings == [f"tsp-train: warning: taking over the stale lease of {out} (host {HOST}, "
                        f"pid {pid}, job 4242, since 2026-01-02T03:04:05Z): its process is gone "
                        "(the OS lock was free)"]
    assert lease.locked
    lease.release()


def test_without_flock_the_lease_file_refuses_a_live_pid_on_this_host(tmp_path, no_flock):
    out = tmp_path / "run"
    live = os.getppid()
    write_lease(out, pid=live, started_ticks=process_start_ticks(live))
    with pytest.raises(LeaseHeld, match=f"host {HOST}, pid {live}, job 4242"):
        acquire(out)
    # The same pid with another start time is a reused pid, not the holder.
    write_lease(out, pid=live, started_ticks=process_start_ticks(live) - 1)
    warnings = []
    lease = acquire(out, warnings)
    assert not lease.locked
    assert len(warnings) == 1 and warnings[0].endswith("its process is gone"), warnings
    # And a second job, also without flock, is refused by the lease file this one wrote.
    with pytest.raises(LeaseHeld, match=f"pid {os.getpid()}"):
        acquire(out)
    lease.release()
    assert not (out / LEASE_FILE).exists()


def test_without_flock_another_hosts_lease_is_live_until_its_heartbeat_is_stale(tmp_path, no_flock):
    out = tmp_path / "run"
    write_lease(out, host="node-b", pid=1234, age_s=540)
    with pytest.raises(LeaseHeld, match="host node-b, pid 1234, job 4242"):
        acquire(out, stale_after_s=600)
    write_lease(out, host="node-b", pid=1234, age_s=660)
    warnings = []
    acquire(out, warnings, stale_after_s=600).release()
    assert len(warnings) == 1 and "host node-b, pid 1234" in warnings[0]
    assert warnings[0].endswith("no heartbeat for 660 s (stale after 600 s)"), warnings


def test_heartbeat_touches_the_lease_file(tmp_path):
    out = tmp_path / "run"
    lease = RunLease.acquire(out, warn=print, heartbeat_s=0.05)
    path = out / LEASE_FILE
    os.utime(path, (time.time() - 1000, time.time() - 1000))
    deadline = time.monotonic() + 5
    while time.time() - path.stat().st_mtime > 100 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert time.time() - path.stat().st_mtime < 100
    lease.release()


def test_other_ranks_refuse_only_another_live_job_on_their_host(tmp_path):
    out = tmp_path / "run"
    live = os.getppid()
    holder = write_lease(out, pid=live, started_ticks=process_start_ticks(live))
    other_job = dataclasses.replace(holder, pid=os.getpid(), job_id="9999")
    with pytest.raises(LeaseHeld, match=f"pid {live}, job 4242"):
        check_not_held_by_another_job(out, other_job)
    check_not_held_by_another_job(out, dataclasses.replace(holder, pid=os.getpid()))   # its rank 0
    write_lease(out, pid=dead_pid())
    check_not_held_by_another_job(out, other_job)          # a gone holder: rank 0 takes it over
    write_lease(out, host="node-b", pid=live)
    check_not_held_by_another_job(out, other_job)          # another host: rank 0 decides


def test_a_check_that_starts_no_job_refuses_a_held_folder_without_taking_it(tmp_path):
    out = tmp_path / "run"
    check_free(out)                                    # no folder yet: nothing to refuse
    lease = acquire(out)
    with pytest.raises(LeaseHeld, match=f"pid {os.getpid()}"):
        check_free(out)
    lease.release()
    write_lease(out, pid=dead_pid())
    check_free(out)                                    # a gone holder: the job's rank 0 takes over
    write_lease(out, host="node-b", pid=1234, age_s=30)
    with pytest.raises(LeaseHeld, match="host node-b, pid 1234"):
        check_free(out)
    assert json.loads((out / LEASE_FILE).read_text())["host"] == "node-b"   # it took nothing


def test_flock_errors_other_than_unsupported_are_raised(tmp_path, monkeypatch):
    def denied(fd, op):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(fcntl, "flock", denied)
    with pytest.raises(OSError, match="Input/output error"):
        acquire(tmp_path / "run")
