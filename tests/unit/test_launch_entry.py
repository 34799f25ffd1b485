"""tsp-launch's use of Accelerate's launcher (engine/launch.py): what it parses, the world size it
checks the recipe at, and the exit code it gives from torch elastic's report of failed ranks."""

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from tsp_trainer.engine.launch import (exit_code, first_failure, launch_world_size,
                                       parse_launch_args)

CPU_CONFIG = "launch/accelerate/cpu_4proc.yaml"


def test_recipe_and_overrides_follow_accelerates_own_options():
    args = parse_launch_args(["--config_file", CPU_CONFIG, "--main_process_port", "0",
                              "recipes/tiny_cpu.yaml", "train.steps=2", "data.seq_len=64"])
    assert args.recipe == "recipes/tiny_cpu.yaml"
    assert args.overrides == ["train.steps=2", "data.seq_len=64"]
    assert args.config_file == CPU_CONFIG and args.main_process_port == 0


def test_module_flag_is_refused_with_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_launch_args(["-m", "recipes/tiny_cpu.yaml"])
    assert exc.value.code == 2
    assert "--module is not needed: tsp-launch runs `-m tsp_trainer train RECIPE` itself" in capsys.readouterr().err


def test_world_size_is_the_flag_else_the_config_files():
    assert launch_world_size(parse_launch_args(["--config_file", CPU_CONFIG, "r.yaml"])) == 4
    assert launch_world_size(parse_launch_args(["--config_file", CPU_CONFIG, "--num_processes", "2",
                                                "r.yaml"])) == 2


def _failure(rank, code, timestamp, tmp_path):
    failure = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code,
                             error_file=str(tmp_path / f"none{rank}"))
    failure.timestamp = timestamp
    return failure


def test_first_rank_to_exit_on_its_own_gives_the_code(tmp_path):
    """Rank 2 exits 2 at t=10; torch elastic then SIGTERMs ranks 0, 1 (-15, same second) and
    rank 3 exits 2 later: the job's code is rank 2's."""
    err = ChildFailedError("tsp_trainer", {0: _failure(0, -15, 10, tmp_path),
                                           1: _failure(1, -15, 10, tmp_path),
                                           2: _failure(2, 2, 10, tmp_path),
                                           3: _failure(3, 2, 11, tmp_path)})
    assert first_failure(err) == (2, 2, 4)


def test_only_signals_give_128_plus_the_signal(tmp_path):
    err = ChildFailedError("tsp_trainer", {1: _failure(1, -9, 5, tmp_path),
                                           0: _failure(0, -15, 6, tmp_path)})
    assert first_failure(err) == (1, 137, 2)
    assert (exit_code(75), exit_code(-15)) == (75, 143)


def test_a_rank_killed_from_outside_is_named_before_the_peers_that_lost_it(tmp_path):
    """Rank 3 is SIGKILLed at t=10; ranks 0 and 1 exit 1 in the same second (lost contact) and
    torch elastic SIGTERMs rank 2: the job's code is rank 3's 137, not rank 0's 1."""
    err = ChildFailedError("tsp_trainer", {0: _failure(0, 1, 10, tmp_path),
                                           1: _failure(1, 1, 10, tmp_path),
                                           2: _failure(2, -15, 10, tmp_path),
                                           3: _failure(3, -9, 10, tmp_path)})
    assert first_failure(err) == (3, 137, 4)
    later = ChildFailedError("tsp_trainer", {0: _failure(0, 2, 10, tmp_path),
                                             1: _failure(1, -9, 40, tmp_path)})
    assert first_failure(later) == (0, 2, 2)     # elastic's SIGKILL after its 30 s grace comes later


@pytest.mark.parametrize("machine,first_rank", [("0", 0), ("1", 4)])
def test_every_machines_launcher_checks_the_inputs_as_its_first_rank(monkeypatch, tmp_path, machine, first_rank):
    """Each machine's tsp-launch checks (one line and exit 2 on every node), as that machine's first
    rank: only machine 0's rank 0 verifies the resume checkpoint and takes the folder's lease."""
    from tsp_trainer import cli
    from tsp_trainer.engine import launch

    from tsp_trainer.config import TrainConfig
    from tsp_trainer.run import startup

    calls, handed = [], []
    monkeypatch.setenv("OMP_NUM_THREADS", "1")     # as set: tsp-launch leaves os.environ alone
    monkeypatch.setattr(cli, "_check_inputs_or_exit",
                        lambda *a, **k: (calls.append((k["world"], k["rank"])), (TrainConfig(), "inputs"))[1])
    monkeypatch.setattr(launch, "run_launcher", lambda args, **kwargs: 0)
    monkeypatch.setattr(startup, "hand_over_check", lambda cfg, inputs, **k: handed.append(k) or tmp_path / "x")
    with pytest.raises(SystemExit) as exc:
        cli.launch_main(["--config_file", CPU_CONFIG, "--num_machines", "2", "--num_processes", "8",
                         "--machine_rank", machine, "recipes/tiny_cpu.yaml"])
    assert exc.value.code == 0 and calls == [(8, first_rank)]
    # the check is handed to this machine's 4 ranks (run/startup.py), which do not repeat it
    assert handed == [{"world_size": 8, "first_rank": first_rank, "ranks_here": 4}]
