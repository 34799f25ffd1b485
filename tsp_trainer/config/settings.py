"""One place per config key: `setting(default, doc=..., min=...)` is the dataclass field of a schema
key and carries, as field metadata, its one-line doc and the rule its value must keep (a numeric
bound, or the allowed values where the type is not a `Literal`). The field's type gives its kind and
its choices (`Literal[...]`). The validator reads the rules (validate.py), `tsp-train --help-config`
and docs/config.md read the docs (reference.py); nothing else restates them.

Standard library only.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Bound:
    """The range a number must lie in: from `low` (inclusive; exclusive when `low_open`) up to
    `high` (exclusive; None = no upper end). Every bounded float must also be finite."""

    low: float
    low_open: bool = False
    high: float | None = None
    note: str = ""                 # what a boundary value means, e.g. "0 = no clipping"

    def allows(self, value: float) -> bool:
        above_low = value > self.low if self.low_open else value >= self.low
        return above_low and (self.high is None or value < self.high)

    def text(self) -> str:
        """'>= 0', '> 0' or 'in [0, 1)', then the note in parentheses."""
        if self.high is None:
            rule = f"{'>' if self.low_open else '>='} {self.low:g}"
        else:
            rule = f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g})"
        return f"{rule} ({self.note})" if self.note else rule


def setting(default: Any = dataclasses.MISSING, *, doc: str,
            factory: Callable[[], Any] | Any = dataclasses.MISSING, min: float | None = None,  # noqa: A002 (the rule's name in every schema field)
            above: float | None = None, below: float | None = None, note: str = "",
            choices: tuple = ()) -> Any:
    """A schema field: `default` (or `factory` for a list), `doc` (one line: what the key means),
    and its rule: `min` (inclusive) or `above` (exclusive) with an optional `below` (exclusive),
    `note` saying what a boundary value means, or `choices` (the allowed values of an int, or of
    each item of a list, whose type is not a Literal)."""
    if min is not None and above is not None:
        raise TypeError("setting() takes min or above, not both")
    low = min if min is not None else above
    bound = None if low is None else Bound(low, low_open=min is None, high=below, note=note)
    return dataclasses.field(default=default, default_factory=factory,
                             metadata={"doc": doc, "bound": bound, "choices": tuple(choices)})


def doc_of(f: dataclasses.Field) -> str:
    return f.metadata.get("doc", "")


def bound_of(f: dataclasses.Field) -> Bound | None:
    return f.metadata.get("bound")


def choices_of(f: dataclasses.Field) -> tuple:
    return f.metadata.get("choices", ())


def field_of(cls: type, name: str) -> dataclasses.Field:
    """The dataclass field `name` of `cls` (a schema section)."""
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def list_of_sections(kind: Any) -> bool:
    """Whether the type `kind` is `list[SomeSection]` (data.sources, data.seq_len_schedule)."""
    args = typing.get_args(kind)
    return typing.get_origin(kind) is list and len(args) == 1 and dataclasses.is_dataclass(args[0])


def leaf_keys(cls: type, prefix: str = "") -> list[str]:
    """The dotted keys of section `cls` and its sub-sections, in schema order ("model.size", ...)."""
    keys = []
    for name, kind in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(kind):
            keys += leaf_keys(kind, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys
