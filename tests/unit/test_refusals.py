"""Refusals that name what is wrong and leave nothing behind: a recipe that is not text, a weight
decay that would wreck the weights at the first update, the folder a refused run made (through
tsp-train: tests/integration/test_lifecycle_launch.py)."""

from pathlib import Path

import pytest

from tsp_trainer.config import load_config, validate_config
from tsp_trainer.run.lease import LOCK_FILE, RunLease

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "tiny_cpu.yaml"


def test_a_binary_recipe_names_itself(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_bytes(b"train:\n  steps: \xa0\xff\n")
    with pytest.raises(ValueError) as err:
        load_config(recipe)
    assert str(err.value) == (f"config file '{recipe}' is not UTF-8 text (byte 0xa0 at offset 16): "
                              "a recipe is a YAML file")


@pytest.mark.parametrize("decay,refused", [(0.0, False), (0.1, False), (300.0, False),
                                           (334.0, True), (1e30, True)])
def test_weight_decay_is_range_checked_against_lr(decay, refused):
    """AdamW scales each decayed weight by 1 - lr * weight_decay per step: at lr 3e-3 a decay of
    334 or more makes that factor 0 or negative."""
    cfg = load_config(RECIPE, [f"optim.weight_decay={decay}", "optim.lr=3e-3"])
    if not refused:
        validate_config(cfg, 4)
        return
    with pytest.raises(ValueError) as err:
        validate_config(cfg, 4)
    line = str(err.value)
    assert line.startswith(f"optim.weight_decay={decay:g} with optim.lr=0.003: ") and "below 333.333" in line


def test_negative_weight_decay_is_refused_by_its_bound():
    with pytest.raises(ValueError, match="optim.weight_decay"):
        validate_config(load_config(RECIPE, ["optim.weight_decay=-0.1"]), 4)


def test_a_lease_removes_the_folders_it_made_when_nothing_was_written(tmp_path):
    out = tmp_path / "new" / "run"
    lease = RunLease.acquire(out, warn=print, heartbeat_s=0)
    assert (out / LOCK_FILE).exists()
    lease.release()
    assert not (tmp_path / "new").exists()          # both folders it made are gone


def test_a_lease_keeps_a_folder_with_a_run_in_it_and_folders_it_did_not_make(tmp_path):
    out = tmp_path / "run"
    lease = RunLease.acquire(out, warn=print, heartbeat_s=0)
    (out / "metrics.jsonl").write_text("{}\n")
    lease.release()
    assert (out / "metrics.jsonl").exists()
    tmp_path.joinpath("existing").mkdir()
    RunLease.acquire(tmp_path / "existing", warn=print, heartbeat_s=0).release()
    assert (tmp_path / "existing").is_dir()
