"""Each process sets torch's intra-op threads to the cores it may use shared by the processes of
its machine (run/threads.py), unless the user set OMP_NUM_THREADS; tsp-launch hands its ranks the
same count through OMP_NUM_THREADS, marked as its own. The count a real process sets:
tests/integration/test_runtime_threads.py."""

import pytest

from tsp_trainer.run.threads import (THREADS_FROM_LAUNCHER, launcher_thread_env, owned_cores,
                                     threads_per_process, user_threads)


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
