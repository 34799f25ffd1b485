"""One source per config key: the schema's settings (type, default, doc, bound) are what the
validator enforces, what the CLIs offer and what `tsp-train --help-config` and docs/config.md say."""

from __future__ import annotations

import copy
import dataclasses
import typing
from pathlib import Path

import pytest

from tsp_trainer.config import validate
from tsp_trainer.config.model import MODEL_SIZES
from tsp_trainer.config.reference import config_reference, config_sections
from tsp_trainer.config.schema import (DataFormat, DType, OptimSection, ParallelSection, Scheme,
                                       TrainConfig, TspRecomputeSetting)
from tsp_trainer.config.settings import Bound, bound_of, field_of, leaf_keys, setting
from tsp_trainer.config.validate import validate_config

DOCS = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def _valid(**parallel) -> TrainConfig:
    """The default config at tsp 2 (valid at world size 4), with parallel keys changed."""
    cfg = TrainConfig()
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tsp_degree=2, **parallel))


def _with_bound(monkeypatch, cls: type, name: str, **rule) -> None:
    """Give the setting cls.name another bound for one test (a copy of its field, new metadata)."""
    new = copy.copy(field_of(cls, name))
    new.metadata = setting(new.default, doc="test", **rule).metadata
    monkeypatch.setitem(cls.__dataclass_fields__, name, new)


# ---------------------------------------------------------------------------------------------
# Bounds come from the settings


def test_a_key_with_min_1_refuses_0_naming_the_key():
    assert bound_of(field_of(ParallelSection, "head_buckets")) == Bound(1)
    with pytest.raises(ValueError, match=r"^parallel.head_buckets=0 must be an integer >= 1$"):
        validate_config(_valid(head_buckets=0))


def test_the_validator_reads_the_int_bound_from_the_setting(monkeypatch):
    validate_config(_valid(head_buckets=1))
    _with_bound(monkeypatch, ParallelSection, "head_buckets", min=2)
    with pytest.raises(ValueError, match=r"^parallel.head_buckets=1 must be an integer >= 2$"):
        validate_config(_valid(head_buckets=1))


def test_the_validator_reads_the_float_bound_from_the_setting(monkeypatch):
    cfg = dataclasses.replace(_valid(), optim=dataclasses.replace(OptimSection(), beta1=0.5))
    validate_config(cfg)
    _with_bound(monkeypatch, OptimSection, "beta1", above=0.6, below=1, note="test note")
    with pytest.raises(ValueError, match=r"^optim.beta1=0.5 must be in \(0.6, 1\) \(test note\)$"):
        validate_config(cfg)


@pytest.mark.parametrize("bound,inside,outside,text", [
    (Bound(0), [0, 5], [-1e-9], ">= 0"),
    (Bound(0, low_open=True), [1e-12], [0, -1], "> 0"),
    (Bound(0, high=1), [0, 0.999], [1, -0.1], "in [0, 1)"),
    (Bound(1, note="1 = no upsampling"), [1], [0.99], ">= 1 (1 = no upsampling)"),
])
def test_bound(bound, inside, outside, text):
    assert [bound.allows(v) for v in inside + outside] == [True] * len(inside) + [False] * len(outside)
    assert bound.text() == text


def test_a_list_item_section_is_checked_by_its_settings():
    from tsp_trainer.config.schema import LengthStageSection

    cfg = _valid()
    stages = [LengthStageSection(0, 0)]
    with pytest.raises(ValueError, match=r"^data.seq_len_schedule\[0\].seq_len=0 must be an integer >= 1$"):
        validate_config(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len_schedule=stages)))


def test_every_scheme_has_its_shape_rule():
    assert tuple(validate._SCHEME_AXES) == typing.get_args(Scheme)


# ---------------------------------------------------------------------------------------------
# --help-config and docs/config.md


def test_the_reference_lists_every_key_with_a_doc():
    from tsp_trainer.config.schema import LengthStageSection, SourceSection

    shown = [k for s in config_sections() for k in s.keys]
    expected = (leaf_keys(TrainConfig) + leaf_keys(SourceSection, "data.sources[].")
                + leaf_keys(LengthStageSection, "data.seq_len_schedule[]."))
    assert sorted(k.dotted for k in shown) == sorted(expected)
    assert [k.dotted for k in shown if not k.doc] == []


def test_help_config_prints_every_key_and_exits_0(capsys):
    from tsp_trainer.cli import train_main

    with pytest.raises(SystemExit) as info:
        train_main(["--help-config"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out == config_reference()
    assert "  parallel.tsp_degree (int, >= 1; default 1)\n" in out
    assert "  parallel.scheme (str, one of tsp, tp, tp_sp, sp, tp_x_sp, ulysses; default tsp)\n" in out
    assert "  optim.beta2 (float, in [0, 1); default 0.95)\n" in out
    assert "  zero.stage (int or str, auto or one of 0, 1, 2, 3; default auto)\n" in out
    assert "  data.sources[].source (str; required)\n" in out
    assert all(f"  {key} (" in out for key in leaf_keys(TrainConfig))


def test_docs_config_md_is_what_help_config_markdown_prints():
    # Regenerate with: tsp-train --help-config --markdown > docs/config.md
    assert DOCS.read_text() == config_reference(markdown=True)
    text = DOCS.read_text()
    assert "| `parallel.tsp_recompute` | str | `auto` | one of auto, full, selective, none |" in text
    assert "| `parallel.head_buckets` | int or str | `auto` | auto or >= 1 |" in text
    assert "| `train.activation_checkpointing` | bool or str | `auto` | auto, true or false |" in text


# ---------------------------------------------------------------------------------------------
# The CLIs offer the schema's choices


def _choices(parser, flag: str, command: str | None = None):
    if command is not None:
        parser = next(a for a in parser._actions if a.dest == "command").choices[command]
    return tuple(next(a for a in parser._actions if flag in a.option_strings).choices)


def test_cli_choices_are_the_schema_types():
    from tsp_trainer.bench.cli import build_parser as bench_parser
    from tsp_trainer.data.tokenize_cli import build_parser as tokenize_parser
    from tsp_trainer.eval.cli import build_parser as eval_parser
    from tsp_trainer.plan.cli import build_parser as plan_parser

    assert _choices(plan_parser(), "--tsp-recompute") == typing.get_args(TspRecomputeSetting)
    assert _choices(bench_parser(), "--tsp-recompute") == typing.get_args(TspRecomputeSetting)
    assert _choices(bench_parser(), "--dtype") == typing.get_args(DType)
    assert _choices(eval_parser(), "--scheme", "passkey") == ("tsp", "tp", "tp_sp", "sp", "tp_x_sp")
    assert _choices(eval_parser(), "--dtype", "loss") == typing.get_args(DType)
    assert _choices(tokenize_parser(), "--data-format") == tuple(
        f for f in typing.get_args(DataFormat) if f != "tokens")


def test_model_size_help_names_every_size():
    from tsp_trainer.bench.cli import build_parser as bench_parser
    from tsp_trainer.plan.cli import build_parser as plan_parser

    for parser in (plan_parser(), bench_parser()):
        help_text = next(a for a in parser._actions if "--model" in a.option_strings).help
        assert f"({', '.join(MODEL_SIZES)}" in help_text
