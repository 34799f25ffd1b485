"""The checks a launcher runs before its ranks, on a job of several nodes: the first rank of the
machine follows from --machine_rank (tsp-launch) or NODE_RANK (launch/torchrun.sh), and a check on
a machine other than the first leaves the run folder's lease to the job's rank 0, which may hold
it already (on one host with two launchers, or on a shared folder)."""

import pytest

from tsp_trainer.cli import _take_run_lease
from tsp_trainer.engine.launch import launch_first_rank, launch_world_size, parse_launch_args
from tsp_trainer.run.lease import LeaseHeld, RunLease

CONFIG = ["--config_file", "launch/accelerate/cpu_4proc.yaml"]


@pytest.mark.parametrize("flags, world, first", [
    (CONFIG, 4, 0),
    (CONFIG + ["--num_machines", "2", "--machine_rank", "1"], 4, 2),
    (["--num_machines", "128", "--num_processes", "1024", "--machine_rank", "5"], 1024, 40),
])
def test_first_rank_of_the_machine(flags, world, first):
    args = parse_launch_args(flags + ["recipes/tiny_cpu.yaml"])
    assert (launch_world_size(args), launch_first_rank(args, world)) == (world, first)


def test_a_check_for_a_later_machine_leaves_the_lease_to_rank_0(tmp_path):
    out = tmp_path / "run"
    held = RunLease.acquire(out, warn=print, heartbeat_s=0)      # the job's rank 0, on machine 0
    try:
        with pytest.raises(LeaseHeld):
            _take_run_lease(str(out), 0, take=False)              # machine 0's check: refused
        _take_run_lease(str(out), 2, take=False)                  # machine 1's check: no refusal
    finally:
        held.release()


def test_a_later_machines_check_prints_its_own_one_line_error(capsys):
    """tsp-launch on machine 1 checks as global rank 2, and still says what is wrong (a tsp-train
    rank other than 0 would leave that line to rank 0)."""
    from tsp_trainer.cli import _check_inputs_or_exit

    with pytest.raises(SystemExit) as exit_:
        _check_inputs_or_exit("recipes/tiny_cpu.yaml", ["train.stpes=3"], world=4, rank=2,
                              prog="tsp-launch", take_lease=False)
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.startswith("tsp-launch: error: config key 'train.stpes' is not a known key") and err.count("\n") == 1
