"""tsp-launch checks a recipe once (run/startup.py): its ranks take the launcher's result (the
data plan, the resume choice; rank 0 decides `auto` once the process group exists) instead of
checking again, when their recipe, overrides and world size are the launcher's; anything else
checks as before. The file between them is plain JSON: nothing in it can run code."""

import pytest

from tsp_trainer.config import load_config
from tsp_trainer.run import startup
from tsp_trainer.run.inputs import check_inputs

RECIPE = "recipes/tiny_cpu.yaml"


@pytest.fixture
def handed(tmp_path, monkeypatch):
    """The launcher's check of the main job (world 4) handed over through the environment."""
    overrides = [f"train.output_dir={tmp_path / 'run'}"]
    cfg = load_config(RECIPE, overrides)
    inputs = check_inputs(cfg, world_size=4, rank=0)
    path = startup.hand_over_check(cfg, inputs, world_size=4, first_rank=0, ranks_here=4)
    monkeypatch.setenv(startup.CHECKED_INPUTS_ENV, str(path))
    yield overrides, inputs
    path.unlink(missing_ok=True)


def test_the_ranks_take_the_launchers_check_and_do_not_repeat_it(handed, monkeypatch):
    overrides, launched = handed
    monkeypatch.setattr("tsp_trainer.run.inputs.check_data_config",
                        lambda *a, **k: pytest.fail("a rank repeated the launcher's data check"))
    cfg = load_config(RECIPE, overrides)
    zero = startup.reuse_launcher_check(cfg, world_size=4, rank=0)
    assert zero.data_plan == launched.data_plan and zero.tokenizer is not None
    assert zero.resume_path == launched.resume_path and zero.resume_meta == launched.resume_meta
    assert zero.resolved is None                  # rank 0 decides `auto` for everyone, in the job
    other = startup.reuse_launcher_check(cfg, world_size=4, rank=3)
    assert other.resolved is None
    assert other.data_plan == launched.data_plan


def test_the_handed_file_is_plain_json(handed, monkeypatch):
    import json
    import os

    record = json.loads(open(os.environ[startup.CHECKED_INPUTS_ENV]).read())
    assert record["world_size"] == 4 and record["cfg"]["train"]["steps"] > 0


def test_another_recipe_world_or_rank_checks_itself(handed):
    overrides, _ = handed
    cfg = load_config(RECIPE, overrides)
    assert startup.reuse_launcher_check(load_config(RECIPE, overrides + ["train.steps=61"]),
                                        world_size=4, rank=0) is None
    assert startup.reuse_launcher_check(cfg, world_size=2, rank=0) is None
    assert startup.reuse_launcher_check(cfg, world_size=4, rank=4) is None     # another machine's


def test_without_the_launcher_nothing_is_reused(tmp_path, monkeypatch):
    monkeypatch.delenv(startup.CHECKED_INPUTS_ENV, raising=False)
    cfg = load_config(RECIPE, [f"train.output_dir={tmp_path / 'run'}"])
    assert startup.reuse_launcher_check(cfg, world_size=4, rank=0) is None
    monkeypatch.setenv(startup.CHECKED_INPUTS_ENV, str(tmp_path / "gone.json"))
    assert startup.reuse_launcher_check(cfg, world_size=4, rank=0) is None


def test_tsp_trains_first_line_says_the_inputs_were_the_launchers(handed, capsys):
    from tsp_trainer.cli import _check_inputs_or_exit, _release_run_lease

    overrides, _ = handed
    try:
        _check_inputs_or_exit(RECIPE, overrides, world=4, rank=0)
    finally:
        _release_run_lease()
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith(
        "tsp-train: start-up: recipe checked, inputs as tsp-launch checked them ("), out
