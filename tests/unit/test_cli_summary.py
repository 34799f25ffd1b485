"""The last line tsp-train prints names where the checkpoints are, and never claims any when
checkpointing is off."""

from types import SimpleNamespace

from tsp_trainer.cli import _summary


def _trainer(enabled: bool, stop_reason=None):
    cfg = SimpleNamespace(train=SimpleNamespace(output_dir="runs/x", steps=4),
                          checkpoint=SimpleNamespace(enabled=enabled))
    return SimpleNamespace(cfg=cfg, state=SimpleNamespace(step=4), stop_reason=stop_reason,
                           stopper=SimpleNamespace(exit_code=75))


def test_summary_names_the_checkpoints_only_when_there_are_any():
    history = [{"train/loss": 2.0}, {"train/loss": 1.5}]
    assert _summary(_trainer(True), history).endswith("checkpoints in runs/x/checkpoints")
    off = _summary(_trainer(False), history)
    assert "checkpoints in" not in off and "checkpoint.enabled=false" in off
    assert "exit code 75" in _summary(_trainer(True, "signal SIGTERM"), history)


def test_the_input_check_prints_one_start_up_line_on_rank_0_only(tmp_path, capsys):
    """The first seconds of a launch are the input checks: rank 0 says when they are done and how
    long the process has run; the other ranks stay silent; `check` has its own ok line instead."""
    import re

    from tsp_trainer.cli import _check_inputs_or_exit, _release_run_lease

    overrides = [f"train.output_dir={tmp_path / 'run'}"]
    cfg, _ = _check_inputs_or_exit("recipes/tiny_cpu.yaml", overrides, world=4, rank=0)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and re.fullmatch(
        r"tsp-train: start-up: recipe and inputs checked \(config, tokenizer, data, resume path, "
        r"output folder\) \(\d+\.\d s\)", out[0]), out
    assert cfg.train.output_dir == str(tmp_path / "run")
    try:
        _check_inputs_or_exit("recipes/tiny_cpu.yaml", overrides, world=4, rank=1)
        _release_run_lease()          # rank 0's call above holds the folder, as a job would
        _check_inputs_or_exit("recipes/tiny_cpu.yaml", overrides, world=4, rank=0, report=False)
        assert capsys.readouterr() == ("", "")
    finally:
        _release_run_lease()
