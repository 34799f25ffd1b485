"""The reference of every config key, read from the schema's settings (schema.py, settings.py):
`tsp-train --help-config` prints it as text, `--help-config --markdown` as docs/config.md (a test
checks that the committed file equals it). Standard library only.
"""

from __future__ import annotations

import dataclasses
import textwrap
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, Union

from tsp_trainer.config.schema import TrainConfig
from tsp_trainer.config.settings import bound_of, choices_of, doc_of, list_of_sections

_MARKDOWN_INTRO = """\
# Configuration keys

Every key a recipe (`recipes/*.yaml`) or a `section.key=value` override may set, by section: its
type, default, allowed values and meaning. `null` in a default means "not set" (the doc says what
is used instead). The loader refuses unknown keys and values of the wrong type; `validate_config`
refuses values outside the allowed ones, each with one line naming the key.

This file is generated from the schema (`tsp_trainer/config/schema.py`) by
`tsp-train --help-config --markdown > docs/config.md`; a test checks that it matches.
"""


REQUIRED = "required"     # the default of a key that has none


@dataclass(frozen=True)
class Key:
    """One config key as the reference shows it."""

    dotted: str        # e.g. "parallel.tsp_degree", "data.sources[].weight"
    kind: str          # "int", "float or null", "list of str", ...
    default: str       # as YAML writes it: 1, null, true, [SIGTERM, SIGUSR1]; or REQUIRED
    allowed: str       # choices or bound; "" = any value of the type
    doc: str


@dataclass(frozen=True)
class Section:
    name: str          # e.g. "parallel", "model.rope_scaling", "data.sources[]"
    doc: str           # the section class's docstring, one paragraph
    keys: list[Key]


def config_sections() -> list[Section]:
    """Every section of TrainConfig in schema order, a sub-section (model.rope_scaling) or a list
    item (data.sources[]) right after the section holding it."""
    return _sections(TrainConfig, "")


def config_reference(*, markdown: bool = False) -> str:
    return _markdown(config_sections()) if markdown else _text(config_sections())


def _sections(cls: type, prefix: str) -> list[Section]:
    out: list[Section] = []
    for f in dataclasses.fields(cls):
        kind = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(kind):
            out += _section(kind, prefix + f.name)
    return out


def _section(cls: type, name: str) -> list[Section]:
    """`cls` as section `name`, followed by the sections nested in it."""
    hints = typing.get_type_hints(cls)
    keys, nested = [], []
    for f in dataclasses.fields(cls):
        kind, dotted = hints[f.name], f"{name}.{f.name}"
        if dataclasses.is_dataclass(kind):
            nested += _section(kind, dotted)
            continue
        shown = _kind(kind)
        if list_of_sections(kind):
            nested += _section(typing.get_args(kind)[0], dotted + "[]")
            shown = f"list of {dotted}[] entries"
        keys.append(Key(dotted, shown, _default(f), _allowed(f, kind), doc_of(f)))
    return [Section(name, " ".join((cls.__doc__ or "").split()), keys), *nested]


def _kind(kind: Any) -> str:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is Literal:
        return type(args[0]).__name__
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _kind(a) for a in args)
    if origin is list:
        return f"list of {_kind(args[0])}"
    return kind.__name__


def _default(f: dataclasses.Field) -> str:
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return REQUIRED if value == "???" else _yaml(value)      # "???": OmegaConf's missing value


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    return str(value)


def _allowed(f: dataclasses.Field, kind: Any) -> str:
    """The Literal's choices, the setting's choices (each item's, for a list) or its bound."""
    literals = [a for a in (kind, *typing.get_args(kind)) if typing.get_origin(a) is Literal]
    others = [a for a in typing.get_args(kind) if a is not type(None) and a not in literals]
    if literals and typing.get_origin(kind) is not Literal and others:
        # `int | Literal["auto"]`, `bool | Literal["auto"]`: the word, or the other type's rule
        words = ", ".join(map(str, typing.get_args(literals[0])))
        if bool in others:
            return f"{words}, true or false"
        if choices_of(f):                    # `int | Literal["auto"]` with the int's choices
            return f"{words} or one of " + ", ".join(map(str, choices_of(f)))
        return f"{words} or {bound_of(f).text()}" if bound_of(f) is not None else words
    if literals:
        words = ", ".join(map(str, typing.get_args(literals[0])))
        if bound_of(f) is not None:          # a number or a word (int | Literal["auto"])
            return f"{words}, or {bound_of(f).text()}"
        return "one of " + words
    if choices_of(f):
        each = "each one of " if typing.get_origin(kind) is list else "one of "
        return each + ", ".join(map(str, choices_of(f)))
    bound = bound_of(f)
    return bound.text() if bound is not None else ""


def _text(sections: list[Section]) -> str:
    lines = ["tsp-train config keys (recipe YAML or section.key=value overrides), by section.", ""]
    for section in sections:
        lines += textwrap.wrap(f"{section.name}: {section.doc}", 100, subsequent_indent="  ")
        for key in section.keys:
            rule = f", {key.allowed}" if key.allowed else ""
            default = REQUIRED if key.default == REQUIRED else f"default {key.default}"
            lines.append(f"  {key.dotted} ({key.kind}{rule}; {default})")
            lines += textwrap.wrap(key.doc, 100, initial_indent=" " * 6, subsequent_indent=" " * 6)
        lines.append("")
    return "\n".join(lines)


def _markdown(sections: list[Section]) -> str:
    lines = [_MARKDOWN_INTRO]
    for section in sections:
        lines += [f"## `{section.name}`", ""]
        if section.doc:
            lines += [section.doc, ""]
        lines += ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
        for key in section.keys:
            default = REQUIRED if key.default == REQUIRED else f"`{key.default}`"
            cells = [f"`{key.dotted}`", key.kind, default, key.allowed, key.doc]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        lines.append("")
    return "\n".join(lines)
