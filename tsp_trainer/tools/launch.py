"""run_on_ranks(fn, world_size, *args): start `world_size` processes, initialise a process group
in each (gloo with fork on CPU; nccl with spawn, one GPU per rank), run fn(rank, world_size, *args)
and return the per-rank results. A failure on any rank raises RuntimeError with its traceback.

tests/helpers/dist.py runs every distributed test through it, with test-sized limits. Fork keeps
start-up at ~0.1 s on CPU; each rank leaves through os._exit after destroy_process_group, skipping
the interpreter's finalization, where DeepSpeed and gloo together can abort the process (SIGABRT)
and fail a run that succeeded. CUDA cannot be initialised in a forked child of a process that touched it, so nccl
ranks are spawned (fn and args must then be picklable: module-level functions, plain data)."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import time
import traceback


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world, port, queue, args, backend, threads, pg_timeout_s):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS=str(threads))
    code = 0
    try:
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        result = fn(rank, world, *args)
        dist.barrier()
        dist.destroy_process_group()
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:
        queue.put((rank, "err", traceback.format_exc()))
        code = 1
    os._exit(code)


def run_on_ranks(fn, world_size: int, *args, backend: str = "gloo", threads: int = 1,
                 timeout: float = 3600, pg_timeout_s: float = 1800):
    ctx = mp.get_context("spawn" if backend == "nccl" else "fork")
    queue, port = ctx.SimpleQueue(), _free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, queue, args, backend, threads,
                                               pg_timeout_s))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors, deadline = {}, [], time.time() + timeout
    while len(results) + len(errors) < world_size and time.time() < deadline:
        if not queue.empty():
            rank, status, payload = queue.get()
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors.append(f"rank {rank}:\n{payload}")
                deadline = min(deadline, time.time() + 10)   # peers may hang in a collective
        elif not any(p.is_alive() for p in procs) and queue.empty():
            break
        else:
            time.sleep(0.01)
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    if errors or len(results) != world_size:
        codes = [p.exitcode for p in procs]
        # A rank killed by the OOM killer leaves no traceback: say so.
        hint = " (a rank was killed: out of memory?)" if any(c is not None and c < 0 for c in codes) else ""
        raise RuntimeError("distributed run failed" + hint + ":\n" + "\n".join(errors) +
                           f"\nexit codes {codes}")
    return [results[r] for r in range(world_size)]
