"""The last line tsp-train prints names where the checkpoints are, and never claims any when
checkpointing is off."""

from types import SimpleNamespace

from tsp_trainer.cli import _summary


def _trainer(enabled: bool, stop_reason=None):
    cfg = SimpleNamespace(train=SimpleNamespace(output_dir="runs/x", steps=4),
                          checkpoint=SimpleNamespace(enabled=enabled))
    return SimpleNamespace(cfg=cfg, state=SimpleNamespace(step=4), stop_reason=stop_reason)


def test_summary_names_the_checkpoints_only_when_there_are_any():
    history = [{"train/loss": 2.0}, {"train/loss": 1.5}]
    assert _summary(_trainer(True), history).endswith("checkpoints in runs/x/checkpoints")
    off = _summary(_trainer(False), history)
    assert "checkpoints in" not in off and "checkpoint.enabled=false" in off
    assert "exit code 75" in _summary(_trainer(True, "signal SIGTERM"), history)
