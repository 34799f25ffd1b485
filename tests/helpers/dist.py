"""run_on_ranks(fn, world_size, *args): fork `world_size` processes, initialise a gloo process
group with a short timeout in each, run fn(rank, world_size, *args) and return the per-rank
results (picklable). A failure on any rank raises AssertionError with that rank's traceback.

Fork (not spawn) keeps the start-up cost at ~0.1 s; each rank leaves through os._exit after
destroy_process_group, which avoids the DeepSpeed + gloo SIGABRT at interpreter exit
(ENV_NOTES.md section 3)."""

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


def _worker(fn, rank, world, port, queue, args, pg_timeout_s):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    code = 0
    try:
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        result = fn(rank, world, *args)
        dist.barrier()
        dist.destroy_process_group()
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:
        queue.put((rank, "err", traceback.format_exc()))
        code = 1
    os._exit(code)


def run_on_ranks(fn, world_size: int, *args, timeout: float = 240, pg_timeout_s: float = 60):
    ctx = mp.get_context("fork")
    queue, port = ctx.SimpleQueue(), _free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, queue, args, pg_timeout_s))
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
        elif not any(p.is_alive() for p in procs) and queue.empty():
            break
        else:
            time.sleep(0.005)
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    if errors or len(results) != world_size:
        codes = [p.exitcode for p in procs]
        raise AssertionError("distributed run failed:\n" + "\n".join(errors) + f"\nexit codes {codes}")
    return [results[r] for r in range(world_size)]
