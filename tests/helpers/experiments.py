"""load_experiment(name): the module of experiments/<name>.py, loaded from its file (the scripts
are not a package; tests call their main() with small sizes so they cannot rot)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


def load_experiment(name: str):
    spec = importlib.util.spec_from_file_location(name, EXPERIMENTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
