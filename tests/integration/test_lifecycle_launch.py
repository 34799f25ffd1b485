"""The run lifecycle as a user meets it, through the real launchers (subprocesses): two jobs on one
machine do not collide; input errors are one line from rank 0 before start-up; the launch lines in
the recipes name a launcher config that fits; the SLURM script forwards a preemption signal to the
trainer and requeues (with stand-ins for srun / scontrol). A run stopped by SIGTERM and by Ctrl-C
and resumed through the launchers: test_interrupt_launch.py."""

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SHORT = ["data.seq_len=64", "optim.warmup_steps=1", "logging.progress_bar=false"]


def _env(**extra):
    env = dict(os.environ, **{"DS_ACCELERATOR": "cpu", "WANDB_MODE": "disabled", **extra})
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR"):
        env.pop(key, None)
    return env


def recipe_launch_line(recipe: str, launchers=("tsp-launch", "sbatch ")) -> str:
    """The first launch command written in a recipe's header comment that starts with one of
    `launchers`."""
    for line in (REPO / "recipes" / recipe).read_text().splitlines():
        text = line.lstrip("# ").strip()
        if text.startswith(launchers):
            return text.split("  (")[0].strip()
    raise AssertionError(f"recipes/{recipe} has no {' / '.join(launchers)} line in its comments")


def _accelerate(recipe_args: list[str]) -> list[str]:
    cmd = shlex.split(recipe_launch_line("tiny_cpu.yaml", ("accelerate launch",)))
    return [str(BIN / "accelerate")] + cmd[1:] + recipe_args


@pytest.mark.parametrize("recipe", sorted(p.name for p in (REPO / "recipes").glob("*.yaml")
                                          if p.name != "base.yaml"))
def test_recipe_launch_lines_name_a_launcher_config_for_their_world(recipe, tmp_path):
    """The commented launch line works as written: it names an existing launcher config (not only
    --num_processes, which fails on CPU) and this recipe, which validates at that config's number
    of processes. (tiny_cpu's accelerate line is also run as written, by
    test_interrupt_launch.py.)"""
    line = recipe_launch_line(recipe)
    if line.startswith("sbatch "):
        script = (REPO / line.split()[1]).read_text()
        assert f"recipes/{recipe}" in script
        return
    args = shlex.split(line)
    assert args[0] == "tsp-launch" and args[-1] == f"recipes/{recipe}", args
    config = yaml.safe_load((REPO / args[args.index("--config_file") + 1]).read_text())
    from tsp_trainer.config import load_config, validate_config

    # The recipe validates at the launcher config's world size (mesh, batch and shape rules).
    cfg = load_config(REPO / "recipes" / recipe)
    if cfg.model.init_from is not None:        # a placeholder the user edits: stand in a folder
        from tests.unit.test_config import _llama31_folder

        cfg = load_config(REPO / "recipes" / recipe, [f"model.init_from={_llama31_folder(tmp_path)}"])
    validate_config(cfg, config["num_processes"])


def test_readme_main_job_is_a_recipe_launch_line():
    """The README's main job is written as in recipes/tiny_cpu.yaml: its tsp-launch line, or the
    plain `accelerate launch` line the recipe gives beside it."""
    readme = (REPO / "README.md").read_text()
    lines = [recipe_launch_line("tiny_cpu.yaml", (launcher,)) for launcher in ("tsp-launch",
                                                                                "accelerate launch")]
    assert any(line in readme for line in lines), lines


@pytest.mark.slow
def test_two_jobs_on_one_machine_do_not_collide(tmp_path):
    """launch/accelerate/cpu_4proc.yaml fixes no port (a fixed one would collide); two launches at
    once both finish."""
    procs = [subprocess.Popen(_accelerate(["train.steps=2", f"train.output_dir={tmp_path / str(i)}"]
                                          + SHORT), cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=500)
        assert proc.returncode == 0, stderr[-3000:]
        assert "tsp-train: done: 2 steps" in stdout


@pytest.mark.slow
def test_two_torchrun_jobs_on_one_machine_do_not_collide(tmp_path):
    env = _env(NPROC="2", PYTHON=sys.executable)
    procs = [subprocess.Popen(["bash", "launch/torchrun.sh", "recipes/tiny_cpu.yaml", "train.steps=2",
                               f"train.output_dir={tmp_path / str(i)}"] + SHORT, cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=500)
        assert proc.returncode == 0, stderr[-3000:]


def _used_folder(tmp_path):
    out = tmp_path / "used"
    (out / "checkpoints" / "step_00000040").mkdir(parents=True)
    (out / "checkpoints" / "step_00000040" / "manifest.json").write_text("{}")
    (out / "checkpoints" / "latest").write_text("step_00000040\n")
    return out


def _single_process_error(out):
    single = subprocess.run([str(BIN / "tsp-train"), "recipes/tiny_cpu.yaml", "parallel.tsp_degree=1",
                             f"train.output_dir={out}"], cwd=REPO, env=_env(), capture_output=True,
                            text=True, timeout=300)
    assert single.returncode == 2 and single.stdout == ""
    errors = [x for x in single.stderr.splitlines() if x.startswith("tsp-train: error:")]
    assert len(errors) == 1 and "already holds checkpoints" in errors[0], single.stderr
    return errors


def test_input_error_is_one_line_and_exit_code_2(tmp_path):
    """A relaunch into a used folder with resume=none: tsp-train exits 2 with one line."""
    _single_process_error(_used_folder(tmp_path))


def test_a_refused_tsp_train_leaves_no_folder(tmp_path):
    """Rank 0 takes the lease (making the folder) before the data check refuses the run."""
    out = tmp_path / "made" / "run"
    proc = subprocess.run([sys.executable, "-m", "tsp_trainer", "train", "recipes/tiny_cpu.yaml", "parallel.tsp_degree=1",
                           f"data.source={tmp_path / 'missing'}", f"train.output_dir={out}"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "does not exist" in proc.stderr
    assert not (tmp_path / "made").exists()


@pytest.mark.slow
def test_input_errors_are_one_line_from_rank_0_before_start_up(tmp_path):
    """The same under accelerate launch (4 ranks): rank 0 prints the same one line, the other ranks
    nothing, and no DeepSpeed or Accelerate start-up happened; the launcher adds its
    ChildFailedError summary."""
    out = _used_folder(tmp_path)
    errors = _single_process_error(out)
    t0 = time.monotonic()
    launched = subprocess.run(_accelerate([f"train.output_dir={out}"]), cwd=REPO, env=_env(),
                              capture_output=True, text=True, timeout=300)
    seconds = time.monotonic() - t0
    print(f"\ninput error under accelerate launch (4 ranks): {seconds:.1f} s to the launcher's exit")
    assert launched.returncode != 0
    lines = [x for x in launched.stderr.splitlines() if "tsp-train: error" in x]
    assert lines == errors, launched.stderr[-3000:]
    assert "ChildFailedError" in launched.stderr and "exitcode  : 2" in launched.stderr
    assert not re.search(r"DeepSpeed info|Initializing TorchBackend|deepspeed.runtime", launched.stderr)


def test_slurm_script_forwards_the_preemption_signal_and_requeues(tmp_path):
    """The sbatch script under stand-ins for srun, scancel and scontrol: USR1 to the batch shell
    (SLURM's --signal=B:USR1 lead time) reaches the srun step as SIGTERM (scancel --signal=TERM
    JOB: the steps' processes); once the step has exited the job requeues itself. Without a signal
    a failing step's status is the script's. (Under a real SLURM: tests/integration/
    test_slurm_cluster.py.)"""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text('#!/bin/bash\nif [ "$1" = show ]; then echo node0; '
                                   'else echo "$*" >> "$LOG"; fi\n')
    # scancel stand-in: SIGTERM to the step (the srun stand-in's pid).
    (fake / "scancel").write_text('#!/bin/bash\necho "scancel $*" >> "$LOG"\n'
                                  'kill -TERM "$(cat "$LOG.srun")"\n')
    # srun stand-in: the "trainer" saves on SIGTERM (after a moment) and exits 75.
    (fake / "srun").write_text('#!/bin/bash\ntrap \'sleep 0.5; echo saved >> "$LOG"; exit 75\' TERM\n'
                               'echo $$ > "$LOG.srun"\n'
                               'echo started >> "$LOG"\nfor i in $(seq 300); do sleep 0.1; done\n'
                               'exit ${SRUN_STATUS:-0}\n')
    for f in fake.iterdir():
        f.chmod(0o755)
    log = tmp_path / "log"
    env = _env(PATH=f"{fake}:{os.environ['PATH']}", LOG=str(log), SLURM_JOB_ID="42",
               SLURM_JOB_NODELIST="node0", SLURM_NNODES="1", SLURM_SUBMIT_DIR=str(tmp_path),
               REPO=str(tmp_path))
    script = str(REPO / "launch" / "slurm_7b_128k_1024gpu.sbatch")
    job = subprocess.Popen(["bash", script], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True)
    while not (log.exists() and "started" in log.read_text()):
        time.sleep(0.05)
    job.send_signal(signal.SIGUSR1)
    stdout, _ = job.communicate(timeout=60)
    assert job.returncode == 0, stdout
    assert log.read_text().splitlines() == ["started", "scancel --signal=TERM 42", "saved",
                                            "requeue 42"], log.read_text()
    assert "caught USR1" in stdout
    log.unlink()
    (fake / "srun").write_text('#!/bin/bash\necho started >> "$LOG"\nexit 3\n')
    plain = subprocess.run(["bash", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=60)
    assert plain.returncode == 3 and "requeue" not in log.read_text()
