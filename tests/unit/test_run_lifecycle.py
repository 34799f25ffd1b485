"""The run lifecycle without processes (tsp_trainer/run/): the output-folder rules, resume paths,
metrics.jsonl rewrite, run identity and W&B plan, preemption flag and max-runtime clock on a
one-rank Comm, the hang watchdog's dump, the ops-in-flight record, pruning that never deletes what
`latest` names, config rules for the new keys, and the input checks' one-line errors."""

from __future__ import annotations

import io
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.distributed.trainer_cases import config
from tsp_trainer.checkpoint.disk_format import (build_manifest, file_entry, find_checkpoint,
                                                latest_checkpoint)
from tsp_trainer.checkpoint.store import CheckpointStore
from tsp_trainer.config import load_config, validate_config
from tsp_trainer.parallel.comm import Comm, CommError, _Work
from tsp_trainer.parallel.ledger import CommLedger
from tsp_trainer.run import (EXIT_BAD_INPUT, EXIT_PREEMPTED, HangWatchdog, StopAgreement,
                             check_inputs, check_output_dir, resolve_identity, resolve_resume,
                             rewrite_metrics, wandb_resume)
from tsp_trainer.run.rundir import claim_output_dir

REPO = Path(__file__).resolve().parents[2]


def one_rank(axis="world") -> Comm:
    return Comm(None, [0], 0, CommLedger(), axis)


def fake_checkpoint(root: Path, step: int) -> Path:
    """A published-looking step folder (manifest present) and `latest` naming it."""
    folder = root / f"step_{step:08d}"
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text("{}")
    (folder / "meta.json").write_text("{}")
    (root / "latest").write_text(folder.name + "\n")
    return folder


# -- output folders ---------------------------------------------------------------------------------
def test_relaunch_with_resume_none_into_a_used_folder_is_refused_naming_the_choices(tmp_path):
    fake_checkpoint(tmp_path / "checkpoints", 40)
    with pytest.raises(ValueError) as info:
        check_output_dir(str(tmp_path), resume="none", resume_path=None, overwrite=False)
    message = str(info.value)
    assert "\n" not in message and "step_00000040" in message
    for choice in ("train.resume=auto", "another train.output_dir", "train.overwrite_output_dir=true"):
        assert choice in message, message
    check_output_dir(str(tmp_path), resume="none", resume_path=None, overwrite=True)     # allowed
    check_output_dir(str(tmp_path), resume="auto", resume_path=None, overwrite=False)    # continues


def test_overwrite_conflicts_and_another_runs_checkpoint(tmp_path):
    own = fake_checkpoint(tmp_path / "run" / "checkpoints", 4)
    other = fake_checkpoint(tmp_path / "other" / "checkpoints", 2)
    run = str(tmp_path / "run")
    with pytest.raises(ValueError, match="would delete the checkpoints"):
        check_output_dir(run, resume="auto", resume_path=own, overwrite=True)
    with pytest.raises(ValueError, match="continues another run's checkpoint"):
        check_output_dir(run, resume=str(other), resume_path=other, overwrite=False)
    check_output_dir(run, resume=str(own), resume_path=own, overwrite=False)     # a rollback: fine


def test_unwritable_output_dir_is_one_line(tmp_path):
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    with pytest.raises(ValueError) as info:
        check_output_dir(str(blocker / "run"), resume="none", resume_path=None, overwrite=False)
    assert "is not writable" in str(info.value) and "\n" not in str(info.value)
    if os.geteuid() != 0:                    # root writes through read-only permission bits
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="is not writable"):
            check_output_dir(str(ro), resume="none", resume_path=None, overwrite=False)


def test_claim_with_overwrite_removes_the_earlier_run(tmp_path):
    fake_checkpoint(tmp_path / "checkpoints", 40)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "run.json").write_text("{}")
    (tmp_path / "config.yaml").write_text("x: 1\n")
    assert claim_output_dir(tmp_path, overwrite=True) == ["checkpoints", "metrics.jsonl", "run.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]
    assert claim_output_dir(tmp_path, overwrite=False) == []


def test_resume_takes_a_step_folder_a_checkpoints_root_or_a_run_folder(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    fake_checkpoint(root, 2)
    last = fake_checkpoint(root, 4)
    for given in (last, root, tmp_path / "run"):
        assert resolve_resume(str(given), str(tmp_path / "x")) == last
    assert resolve_resume("auto", str(tmp_path / "run")) == last
    assert resolve_resume("auto", str(tmp_path / "empty")) is None
    assert resolve_resume("none", str(tmp_path / "run")) is None
    with pytest.raises(ValueError, match="neither a complete checkpoint"):
        resolve_resume(str(tmp_path), str(tmp_path / "x"))


def test_latest_falls_back_to_the_newest_complete_checkpoint(tmp_path):
    fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 4)
    (tmp_path / "latest").write_text("step_00000009\n")            # names a folder that is gone
    assert latest_checkpoint(tmp_path).name == "step_00000004"
    (tmp_path / "latest").unlink()
    assert find_checkpoint(tmp_path).name == "step_00000004"


def test_rewrite_metrics_keeps_each_step_once_up_to_the_resumed_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": s, "loss": float(s)} for s in (1, 2, 3, 4, 5, 6, 7)]
    lines += [{"step": 5, "loss": 50.0}, {"step": 6, "loss": 60.0}]          # an old append-after-resume
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 8, "lo')   # cut short
    assert rewrite_metrics(path, up_to_step=5) == 7
    kept = [json.loads(x) for x in path.read_text().splitlines()]
    assert [m["step"] for m in kept] == [1, 2, 3, 4, 5] and kept[-1]["loss"] == 50.0
    assert rewrite_metrics(tmp_path / "missing.jsonl", up_to_step=0) is None


def test_publish_never_prunes_the_checkpoint_latest_names(tmp_path):
    """A run kept step 20, 30, 40 (keep_last=3); a 5-step run saved into the same folder is kept
    (it is what `latest` names) and the later steps of the abandoned run are pruned."""
    store = CheckpointStore(tmp_path, world=one_rank(), keep_last=3)

    def save(step):
        tmp = store.begin(step)
        (tmp / "model" / "w").write_bytes(b"w")
        return store.publish(tmp, step, {"step": step}, {"model/w": file_entry(tmp / "model" / "w")})
    for step in (10, 20, 30, 40):
        save(step)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000020", "step_00000030",
                                                               "step_00000040"]
    save(5)
    assert store.latest() == tmp_path / "step_00000005" and store.latest().exists()
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000005"]
    for step in (6, 7, 8):
        save(step)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000006", "step_00000007",
                                                               "step_00000008"]


# -- identity and W&B plan ------------------------------------------------------------------------
def test_identity_is_kept_across_relaunches_and_new_for_a_fresh_run(tmp_path):
    first = resolve_identity(tmp_path, run_name=None, continues=False, checkpoint_meta=None)
    assert first.name == tmp_path.name and len(first.wandb_run_id) == 8
    again = resolve_identity(tmp_path, run_name=None, continues=True, checkpoint_meta=None)
    assert again == first
    fresh = resolve_identity(tmp_path, run_name="mine", continues=False, checkpoint_meta=None)
    assert fresh.wandb_run_id != first.wandb_run_id and fresh.name == "mine"
    (tmp_path / "run.json").unlink()                             # a folder copied without it
    from_ckpt = resolve_identity(tmp_path, run_name=None, continues=True,
                                 checkpoint_meta={"run": first.as_dict()})
    assert from_ckpt == first


def test_wandb_plan():
    assert wandb_resume(replay="skip", continues=False, resumed_step=0, last_logged_step=9).continues is False
    skip = wandb_resume(replay="skip", continues=True, resumed_step=4, last_logged_step=7)
    assert (skip.skip_through_step, skip.rewind_to_step) == (7, None)
    rewind = wandb_resume(replay="rewind", continues=True, resumed_step=4, last_logged_step=7)
    assert (rewind.skip_through_step, rewind.rewind_to_step) == (None, 4)


# -- preemption -------------------------------------------------------------------------------------
def test_signal_sets_the_flag_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGUSR1)
    stopper = StopAgreement(one_rank(), signals=["SIGTERM", "SIGUSR1"])
    with stopper:
        assert stopper.agree(step_s=0, save_s=0) is None
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)                     # the first signal is the one named
        assert stopper.received == "SIGUSR1"
        assert stopper.agree(step_s=0, save_s=0) == "signal SIGUSR1"
    assert signal.getsignal(signal.SIGUSR1) == before


def test_max_runtime_leaves_room_for_one_step_and_the_save():
    now = [1000.0]
    stopper = StopAgreement(one_rank(), signals=[], max_runtime_s=100, clock=lambda: now[0])
    now[0] += 80
    assert stopper.agree(step_s=5, save_s=10) is None            # 80 + 15 < 100
    now[0] += 6
    assert "max_runtime_min" in stopper.agree(step_s=5, save_s=10)
    unlimited = StopAgreement(one_rank(), signals=[], max_runtime_s=0, clock=lambda: 1e9)
    assert unlimited.agree(step_s=1e9, save_s=1e9) is None


def test_exit_codes_are_the_documented_ones():
    from tsp_trainer import cli

    assert (EXIT_BAD_INPUT, EXIT_PREEMPTED) == (2, 75)
    assert (cli.EXIT_BAD_INPUT, cli.EXIT_PREEMPTED) == (EXIT_BAD_INPUT, EXIT_PREEMPTED)
    assert cli.nccl_env(blocking_wait=True) == {"TORCH_NCCL_BLOCKING_WAIT": "1"}
    assert cli.nccl_env(blocking_wait=False) == {}


# -- stalls: the comm layer's record and errors --------------------------------------------------
class _FailingWork:
    """What a NCCL Work's wait() raises under TORCH_NCCL_BLOCKING_WAIT=1 after the timeout."""

    def wait(self):
        raise torch.distributed.DistBackendError("Work WorkNCCL(OpType=ALLGATHER) timed out in "
                                                 "blocking wait (TORCH_NCCL_BLOCKING_WAIT=1).")


def test_a_backend_timeout_in_wait_becomes_commerror_and_leaves_the_in_flight_record():
    ledger = CommLedger()
    work = _Work(_FailingWork(), lambda: "all_gather of 'attn.kv' (8 bytes) on axis 'tsp'",
                 ledger)
    assert ledger.in_flight.describe()[0].startswith("all_gather of 'attn.kv'")
    with pytest.raises(CommError, match="all_gather of 'attn.kv'.*timed out in blocking wait"):
        work.wait()
    assert ledger.in_flight.describe() == []


def test_foreign_ops_name_the_axes_and_pass_other_errors_through():
    dp = Comm(None, [1, 3], 0, CommLedger(), "dp")
    tsp = Comm(None, [0, 1], 1, dp.ledger, "tsp")
    with pytest.raises(CommError) as info:
        with dp.foreign_ops("DeepSpeed ZeRO step", also=[tsp]):
            assert "DeepSpeed ZeRO step" in dp.ledger.in_flight.describe()[0]
            raise RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed")
    assert "axis 'dp' (global ranks [1, 3]) or axis 'tsp' (global ranks [0, 1]), rank 1" in str(info.value)
    with pytest.raises(ValueError):
        with dp.foreign_ops("x"):
            raise ValueError("not a backend error")
    assert dp.ledger.in_flight.describe() == []


def test_watchdog_dumps_once_per_stuck_step_with_ops_and_stacks(tmp_path):
    stream = io.StringIO()
    ops = ["broadcast of 'attn.weights' on axis 'tsp' (in flight for 1.0 s)"]
    dog = HangWatchdog(dump_after_s=0.2, rank=3, in_flight=lambda: ops, dump_dir=tmp_path,
                       stream=stream)
    with dog:
        dog.step_started(7)
        deadline = time.monotonic() + 10
        while dog.dumps == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.6)                                           # still stuck: no second dump
        dog.step_finished()
    assert dog.dumps == 1
    text = (tmp_path / "rank_00003.txt").read_text()
    assert "[rank 3] hang watchdog: step 7 has run" in text and ops[0] in text
    assert "test_watchdog_dumps_once_per_stuck_step" in text      # the main thread's stack
    assert "hang watchdog: step 7" in stream.getvalue()
    off = HangWatchdog(dump_after_s=0, rank=0, in_flight=list, dump_dir=None)
    with off:
        assert off._thread is None


# -- config and input checks -----------------------------------------------------------------------
@pytest.mark.parametrize("override,message", [
    ("optim.lr=.inf", "optim.lr=inf must be a finite number"),
    ("optim.lr=.nan", "optim.lr=nan must be a finite number"),
    ("optim.lr=-0.1", "optim.lr=-0.1 must be in (0, 1)"),
    ("optim.lr=1e39", "optim.lr=1e+39 must be in (0, 1)"),
    ("optim.max_grad_norm=.inf", "optim.max_grad_norm=inf must be a finite number"),
    ("model.init_std=-1", "model.init_std=-1.0 must be in (0, 1)"),
    ("model.init_std=1e30", "model.init_std=1e+30 must be in (0, 1)"),
    ("optim.warmup_steps=1000", "optim.warmup_steps=1000 exceeds train.steps="),
    ("train.max_runtime_min=-1", "train.max_runtime_min=-1.0 must be >= 0"),
    ("train.hang_dump_s=200", "train.hang_dump_s=200 must be below train.collective_timeout_s=120"),
    ("train.preempt_signals=[SIGKILL]", "train.preempt_signals=['SIGKILL'] must name signals"),
    ("train.max_consecutive_skips=0", "train.max_consecutive_skips=0 must be an integer >= 1"),
])
def test_silent_acceptances_are_refused(override, message):
    with pytest.raises(ValueError) as info:
        validate_config(load_config(REPO / "recipes" / "tiny_cpu.yaml", [override]), 4)
    assert message in str(info.value), str(info.value)


@pytest.mark.parametrize("override,message", [
    ("data.tokenizer=/nonexistent/tok", "tokenizer path '/nonexistent/tok' does not exist"),
    ("data.source=/nonexistent/corpus", "data path '/nonexistent/corpus' does not exist"),
    ("train.resume=/tmp", "train.resume='/tmp' is neither a complete checkpoint"),
    ("train.output_dir=/proc/version/run", "train.output_dir='/proc/version/run' is not writable"),
])
def test_input_errors_are_one_line_before_start_up(override, message):
    with pytest.raises(ValueError) as info:
        check_inputs(config([override]), world_size=4)
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


def _write_meta(folder, meta):
    """meta.json and a manifest that lists it as it now is (the checkpoint verifies)."""
    (folder / "meta.json").write_text(json.dumps(meta))
    (folder / "manifest.json").write_text(json.dumps(build_manifest(folder)))


def test_check_inputs_reads_the_resume_checkpoint_and_refuses_another_model(tmp_path):
    root = tmp_path / "checkpoints"
    folder = fake_checkpoint(root, 4)
    cfg = config([f"train.output_dir={tmp_path}", "train.resume=auto"])
    model = dict(cfg.model.to_model_config().to_dict(), hidden_size=32)
    layout = {"scheme": "tsp", "tsp_degree": 2, "dp_degree": 2, "world_size": 4, "zero_stage": 1}
    _write_meta(folder, {"model": model, "layout": layout})
    with pytest.raises(ValueError, match="another model shape: model.hidden_size=64 here vs 32"):
        check_inputs(cfg, world_size=4)
    _write_meta(folder, {"model": cfg.model.to_model_config().to_dict(), "layout": layout})
    inputs = check_inputs(cfg, world_size=4)
    assert inputs.resume_path == folder and inputs.resume_meta["layout"] == layout
    with pytest.raises(ValueError, match="dp_degree=2 but this run has dp_degree=1"):
        check_inputs(cfg, world_size=2)


def test_wandb_sink_skips_logged_steps_and_marks_preemption(tmp_path, monkeypatch):
    """The sink's side of W&B continuity, offline: steps up to skip_through_step are not sent, a
    preempted run is marked so (MultiSink forwards it; NullSink ignores it)."""
    import wandb

    from tsp_trainer.observability import MultiSink, NullSink, WandbSink

    sent, marked = [], []
    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log",
                        lambda run, data, step=None, **kw: sent.append(step))
    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "mark_preempting", lambda run: marked.append(run.id))
    sink = WandbSink("p", run_name="n", config={}, mode="offline", dir=tmp_path, run_id="abcd0123",
                     continues=True, skip_through_step=5)
    multi = MultiSink([sink, NullSink()])
    for step in (5, 6, 7):
        multi.log(step, {"loss": 1.0})
    multi.mark_preempting()
    multi.close()
    assert sent == [6, 7] and marked == ["abcd0123"]


def test_wandb_sink_outlives_its_killed_service(tmp_path, monkeypatch, capsys):
    """A signal to every process of the job (SLURM) also stops wandb-core: the next log fails with
    ConnectionResetError. The sink says so once and sends nothing more; training goes on to its
    checkpoint (tests/integration/test_slurm_cluster.py runs it under SLURM)."""
    import wandb

    from tsp_trainer.observability import WandbSink

    calls = []

    def lost(run, data, step=None, **kw):
        calls.append(step)
        raise ConnectionResetError("Connection lost")

    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log", lost)
    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "mark_preempting", lambda run: calls.append("mark"))
    sink = WandbSink("p", run_name="n", config={}, mode="offline", dir=tmp_path, run_id="abcd0124")
    for step in (1, 2, 3):
        sink.log(step, {"loss": 1.0})
    sink.mark_preempting()
    sink.close()
    err = capsys.readouterr().err
    assert calls == [1]
    assert err.count("W&B logging stops at step 1: its wandb-core process is gone "
                     "(ConnectionResetError: Connection lost)") == 1, err
