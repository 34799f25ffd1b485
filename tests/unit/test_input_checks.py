"""Bad input the start-up checks refuse in one line (exit 2) before any process group or file
exists: W&B online without credentials."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tsp_trainer.observability.wandb_sink import check_wandb_credentials

KEY = "0123456789abcdef0123456789abcdef01234567"      # the 40-character form of a W&B API key


def _no_login(tmp_path: Path) -> dict[str, str]:
    """The environment without W&B credentials: no key variables, an empty netrc."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    (tmp_path / "netrc").write_text("")
    return env | {"NETRC": str(tmp_path / "netrc"), "HOME": str(tmp_path)}


def test_online_without_credentials_is_refused(tmp_path):
    env = _no_login(tmp_path)
    with pytest.raises(ValueError) as info:
        check_wandb_credentials("online", env)
    assert str(info.value).startswith("logging.wandb_mode='online' needs W&B credentials")
    assert f"no entry for https://api.wandb.ai in {tmp_path / 'netrc'}" in str(info.value)
    check_wandb_credentials("offline", env)                       # offline and disabled need none
    check_wandb_credentials("disabled", env)


def test_online_finds_the_key_where_wandb_does(tmp_path, monkeypatch):
    env = _no_login(tmp_path)
    monkeypatch.setenv("NETRC", env["NETRC"])
    check_wandb_credentials("online", env | {"WANDB_API_KEY": KEY})
    (tmp_path / "netrc").write_text(f"machine api.wandb.ai\n  login user\n  password {KEY}\n")
    (tmp_path / "netrc").chmod(0o600)
    check_wandb_credentials("online", env)
    with pytest.raises(ValueError, match="no entry for https://wandb.example.com"):
        check_wandb_credentials("online", env | {"WANDB_BASE_URL": "https://wandb.example.com"})

