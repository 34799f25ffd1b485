"""One job per run folder: an exclusive lease on train.output_dir, held by global rank 0 for the
whole job.

    lease = RunLease.acquire(output_dir, warn=print)   # LeaseHeld (a ValueError): one line, exit 2
    ...
    lease.release()                                     # also at interpreter exit (atexit)

Two layers, because a run folder usually lives on a shared filesystem:
- an OS lock: fcntl.flock on <output_dir>/.lease.lock, kept open for the job. The kernel drops it
  when the process dies, whatever the death, so on a local disk (and on NFS/Lustre mounts that
  support it) a live holder is certain and a dead one never blocks. Where flock is not supported
  (ENOLCK, EOPNOTSUPP, ENOSYS) the lease file alone decides.
- a lease file, <output_dir>/lease.json: host, pid, the process's start time, job id
  (SLURM_JOB_ID, else TORCHELASTIC_RUN_ID), the rendezvous (MASTER_ADDR:MASTER_PORT) and since
  when. It is created with os.link (atomic, fails if the file exists, also on NFS), so two jobs
  starting at the same moment cannot both write it. A daemon thread touches it every HEARTBEAT_S.

Who holds an existing lease.json (`holder_alive`):
- same host as this process: alive when that pid runs and started at the recorded time (a reused
  pid is not the holder); with the OS lock taken by this process, the holder is gone whatever pid
  runs now (the kernel would have kept its lock);
- another host: alive while its heartbeat (the file's mtime) is younger than STALE_AFTER_S. Clocks
  of the hosts must agree within STALE_AFTER_S - HEARTBEAT_S.
A live holder refuses the job, naming it; a gone one is taken over with one warning line. The
lease is released (lease.json removed, the lock dropped) when the job ends: normally, with an
error or at exit 75. A job that dies without releasing leaves a stale lease the next job takes
over.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from tsp_trainer.run.rundir import probe_writable

LOCK_FILE = ".lease.lock"
LEASE_FILE = "lease.json"
HEARTBEAT_S = 30.0              # rank 0 touches lease.json this often
STALE_AFTER_S = 600.0           # another host's lease without a heartbeat for this long is stale

_HELD: list[RunLease] = []     # the leases this process holds (release_held)

# flock errors that mean "this filesystem cannot lock", not "someone holds the lock".
_NO_LOCKING = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class LeaseHeld(ValueError):
    """Another live job holds the run folder (one line: the folder and the holder)."""


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    started_ticks: int | None       # /proc/<pid>/stat starttime (tells a reused pid apart)
    job_id: str | None              # SLURM_JOB_ID, else TORCHELASTIC_RUN_ID
    rendezvous: str | None          # MASTER_ADDR:MASTER_PORT: the same for every rank of one job
    since: str                      # UTC, ISO 8601

    def describe(self) -> str:
        job = f"job {self.job_id}" if self.job_id else "no job id"
        return f"host {self.host}, pid {self.pid}, {job}, since {self.since}"

    def same_job(self, other: Holder) -> bool:
        return (self.job_id, self.rendezvous) == (other.job_id, other.rendezvous)


def this_process(environ=os.environ) -> Holder:
    job_id = environ.get("SLURM_JOB_ID") or environ.get("TORCHELASTIC_RUN_ID") or None
    addr, port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
    return Holder(host=socket.gethostname(), pid=os.getpid(), started_ticks=process_start_ticks(os.getpid()),
                  job_id=job_id, rendezvous=f"{addr}:{port}" if addr and port else None,
                  since=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def process_start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (clock ticks after boot); None where /proc cannot say."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def pid_alive(pid: int, started_ticks: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:         # it exists, owned by someone else
        pass
    now = process_start_ticks(pid)
    return started_ticks is None or now is None or now == started_ticks


def read_holder(path: Path) -> Holder | None:
    """The holder recorded in a lease file; None if it is missing or unreadable."""
    try:
        raw = json.loads(path.read_text())
        return Holder(host=str(raw["host"]), pid=int(raw["pid"]), started_ticks=raw.get("started_ticks"),
                      job_id=raw.get("job_id"), rendezvous=raw.get("rendezvous"), since=str(raw["since"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def why_gone(holder: Holder, lease_path: Path, *, me: Holder, locked: bool, stale_after_s: float,
             now: float | None = None) -> str | None:
    """Why the recorded holder no longer holds the folder, or None while it does (module docstring)."""
    if holder.host == me.host:
        if locked:
            return "its process is gone (the OS lock was free)"
        return None if pid_alive(holder.pid, holder.started_ticks) else "its process is gone"
    try:
        age = (time.time() if now is None else now) - lease_path.stat().st_mtime
    except FileNotFoundError:
        return "its lease file is gone"
    if age < stale_after_s:
        return None
    return f"no heartbeat for {age:.0f} s (stale after {stale_after_s:.0f} s)"


def refusal(output_dir: str | os.PathLike, holder: Holder | None) -> str:
    who = holder.describe() if holder else "a process that holds its OS lock (lease.json not written yet)"
    return (f"train.output_dir={str(output_dir)!r} is in use by another job ({who}; "
            f"{Path(output_dir) / LEASE_FILE}): one job per output folder; wait for it to end or "
            "write to another train.output_dir")


class RunLease:
    """The lease this process holds (see the module docstring)."""

    def __init__(self, output_dir: Path, lock_fd: int | None, holder: Holder, heartbeat_s: float,
                 created: tuple[Path, ...] = ()):
        self.output_dir = output_dir
        self.created = created        # the folders acquire() made, deepest first
        self.path = output_dir / LEASE_FILE
        self.holder = holder
        self.locked = lock_fd is not None
        self._lock_fd = lock_fd
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if heartbeat_s > 0:
            self._thread = threading.Thread(target=self._beat, args=(heartbeat_s,),
                                            name="tsp-lease-heartbeat", daemon=True)
            self._thread.start()
        _HELD.append(self)
        atexit.register(self.release)

    @classmethod
    def acquire(cls, output_dir: str | os.PathLike, *, warn: Callable[[str], None],
                heartbeat_s: float = HEARTBEAT_S, stale_after_s: float = STALE_AFTER_S,
                me: Holder | None = None) -> RunLease:
        """Take the lease, or raise LeaseHeld naming the live holder. Creates the folder (a
        ValueError names it if it cannot be written)."""
        out = Path(output_dir)
        created = _missing_folders(out)
        probe_writable(str(output_dir))
        me = me or this_process()
        fd = _lock_or_none(out / LOCK_FILE, output_dir)
        try:
            _claim_lease_file(out, me, locked=fd is not None, warn=warn, stale_after_s=stale_after_s)
        except BaseException:
            if fd is not None:
                os.close(fd)
            _remove_if_unused(created)
            raise
        return cls(out, fd, me, heartbeat_s, created)

    def _beat(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            try:
                os.utime(self.path)
            except OSError:         # a filesystem hiccup: the next beat tries again
                pass

    def release(self) -> None:
        """Remove lease.json (if it is still ours) and drop the lock; idempotent."""
        self._stop.set()
        if read_holder(self.path) == self.holder:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
        if self._lock_fd is not None:
            os.close(self._lock_fd)          # closing drops the flock
            self._lock_fd = None
        _remove_if_unused(self.created)      # a refused run leaves no folder it made
        if self in _HELD:
            _HELD.remove(self)


def take_for_job(output_dir: str, rank: int, *, take: bool, warn: Callable[[str], None]) -> None:
    """Rank 0 takes the run folder's lease for the job (released by `release_held`, or at
    interpreter exit); the other ranks refuse a folder held by another job's live process on their
    host; a check that trains nothing (take=False) refuses a folder a live job holds, unless it
    checks for a machine other than the first (rank != 0: that job's own rank 0 may hold the lease
    already). LeaseHeld is a ValueError."""
    if not take:
        if rank == 0:
            check_free(output_dir)
    elif rank == 0:
        RunLease.acquire(output_dir, warn=warn)
    else:
        check_not_held_by_another_job(output_dir)


def _missing_folders(folder: Path) -> tuple[Path, ...]:
    """`folder` and each of its parents that does not exist yet, deepest first."""
    missing = []
    for path in (folder, *folder.parents):
        if path.exists():
            break
        missing.append(path)
    return tuple(missing)


def _remove_if_unused(created: tuple[Path, ...]) -> None:
    """Remove the folders a lease made (deepest first) while they hold nothing but the lock file:
    a run refused by its input checks wrote nothing else. A folder holding anything is kept."""
    for folder in created:
        try:
            if {p.name for p in folder.iterdir()} <= {LOCK_FILE}:
                (folder / LOCK_FILE).unlink(missing_ok=True)
            folder.rmdir()
        except OSError:            # not empty, gone, or not ours to remove
            return


def release_held() -> None:
    """Release every lease of this process: for exits that skip atexit (os._exit)."""
    for lease in list(_HELD):
        lease.release()


def _lock_or_none(lock_path: Path, output_dir) -> int | None:
    """The open, flock-ed lock file; None where the filesystem cannot lock. LeaseHeld if a live
    process holds the lock."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BlockingIOError:
        os.close(fd)
        raise LeaseHeld(refusal(output_dir, _holder_soon(lock_path.parent / LEASE_FILE))) from None
    except OSError as err:
        os.close(fd)
        if err.errno in _NO_LOCKING:
            return None
        raise


def _holder_soon(path: Path, wait_s: float = 2.0) -> Holder | None:
    """The holder of a lock just taken may not have written lease.json yet: wait a moment."""
    deadline = time.monotonic() + wait_s
    while (holder := read_holder(path)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return holder


def _claim_lease_file(out: Path, me: Holder, *, locked: bool, warn: Callable[[str], None],
                      stale_after_s: float) -> None:
    path = out / LEASE_FILE
    staged = out / f".{LEASE_FILE}.{me.host}.{me.pid}"
    staged.write_text(json.dumps(asdict(me), indent=1) + "\n")
    try:
        for _ in range(3):          # each round: create it, or move a gone holder's file away
            try:
                os.link(staged, path)         # atomic: fails if lease.json exists
                return
            except FileExistsError:
                pass
            holder = _holder_soon(path)
            if holder is None:                # vanished meanwhile, or unreadable for 2 s
                gone = "its lease file is unreadable" if path.exists() else None
            else:
                gone = why_gone(holder, path, me=me, locked=locked, stale_after_s=stale_after_s)
                if gone is None:
                    raise LeaseHeld(refusal(out, holder))
            if gone is not None and _move_aside(path, me):
                warn(f"tsp-train: warning: taking over the stale lease of {out} "
                     f"({holder.describe() if holder else 'unknown holder'}): {gone}")
        raise LeaseHeld(refusal(out, read_holder(path)))
    finally:
        staged.unlink(missing_ok=True)


def _move_aside(path: Path, me: Holder) -> bool:
    """Rename a stale lease file away (atomic: of two jobs taking it over, one succeeds)."""
    aside = path.with_name(f".{LEASE_FILE}.stale.{me.host}.{me.pid}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    aside.unlink(missing_ok=True)
    return True


def check_not_held_by_another_job(output_dir: str | os.PathLike, me: Holder | None = None) -> None:
    """Ranks other than 0 (which takes the lease): refuse when lease.json names a live process of
    another job on this host. Anything less certain is left to rank 0, whose exit 2 makes the
    launcher stop this rank (a holder on another host may be gone without this rank knowing)."""
    me = me or this_process()
    holder = read_holder(Path(output_dir) / LEASE_FILE)
    if (holder is not None and holder.host == me.host and not holder.same_job(me)
            and pid_alive(holder.pid, holder.started_ticks)):
        raise LeaseHeld(refusal(output_dir, holder))


def check_free(output_dir: str | os.PathLike, *, stale_after_s: float = STALE_AFTER_S) -> None:
    """A check that starts no job (tsp-launch before its launcher, `check`): refuse a folder whose
    lease.json names a live holder, without taking the lease (the job's rank 0 will)."""
    path = Path(output_dir) / LEASE_FILE
    holder = read_holder(path)
    if holder is not None and why_gone(holder, path, me=this_process(), locked=False,
                                       stale_after_s=stale_after_s) is None:
        raise LeaseHeld(refusal(output_dir, holder))
