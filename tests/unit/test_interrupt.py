"""Ctrl-C (SIGINT) is a stop request at the next step boundary, exit 130; the launcher's own
forward of it is the same request; a later one stops at once; tsp-launch's line is true for each
signal it names."""

import os
import signal

import pytest

from tests.unit.test_run_lifecycle import one_rank
from tsp_trainer.engine.launch import what_ranks_do
from tsp_trainer.run import EXIT_INTERRUPTED, EXIT_PREEMPTED, StopAgreement
from tsp_trainer.run import preemption


def test_sigint_is_a_stop_request_whatever_preempt_signals_say(monkeypatch):
    stopped = []
    monkeypatch.setattr(preemption, "stop_at_once", lambda say: stopped.append(say))
    before = signal.getsignal(signal.SIGINT)
    stopper = StopAgreement(one_rank(), signals=[])
    with stopper:
        assert stopper.agree(step_s=0, save_s=0) is None
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)          # the launcher's forward, moments later
        assert stopped == [] and stopper.received == "SIGINT"
        assert stopper.agree(step_s=0, save_s=0) == "signal SIGINT"
        assert stopper.exit_code == EXIT_INTERRUPTED == 130
        monkeypatch.setattr(preemption, "SECOND_INTERRUPT_AFTER_S", 0.0)
        os.kill(os.getpid(), signal.SIGINT)          # a second Ctrl-C
        assert stopped == [True]                     # rank 0 says it
    assert signal.getsignal(signal.SIGINT) == before


def test_a_preemption_signal_exits_75():
    stopper = StopAgreement(one_rank(), signals=["SIGTERM"])
    with stopper:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stopper.agree(step_s=0, save_s=0) == "signal SIGTERM"
    assert stopper.exit_code == EXIT_PREEMPTED


@pytest.mark.parametrize("sig,says", [
    (signal.SIGINT, "each saves a checkpoint at its next step boundary and exits 130"),
    (signal.SIGTERM, "SIGTERM is in train.preempt_signals, so each saves a checkpoint at its next step "
                     "boundary and exits 75"),
    (signal.SIGHUP, "SIGHUP is not in train.preempt_signals, so they stopped without a checkpoint"),
])
def test_the_launchers_line_is_true_for_each_signal(sig, says):
    assert says in what_ranks_do(sig, ["SIGTERM", "SIGUSR1"])
    if sig == signal.SIGTERM:
        assert "not in train.preempt_signals" in what_ranks_do(sig, [])


def test_cli_knows_the_exit_code():
    from tsp_trainer import cli

    assert cli.EXIT_INTERRUPTED == EXIT_INTERRUPTED
