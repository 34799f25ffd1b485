"""YAML recipe + `key=value` overrides -> TrainConfig. The only module that imports OmegaConf.

Layers are merged in order onto `OmegaConf.structured(TrainConfig)`: the `base:` chain of the recipe
(outermost first), the recipe, then each CLI override. Every layer is checked against the schema
before it is merged, so a mistake is reported as one line naming the full dotted key, the value, the
rule and where it came from; OmegaConf's own messages are multi-line and convert silently (an int 2
into a bool, `no` into a string field as False), which we want to refuse. No DictConfig leaves this
file: the rest of the code sees only the typed dataclasses of schema.py.

OmegaConf (and PyYAML) are imported inside the functions that use them, so `import tsp_trainer.config`,
which the model package does, stays standard-library only.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from pathlib import Path
from typing import Any, Iterable, Literal, Union

from tsp_trainer.config.schema import TrainConfig
from tsp_trainer.config.settings import leaf_keys, list_of_sections

if typing.TYPE_CHECKING:
    import yaml
    from omegaconf import DictConfig
    from omegaconf.errors import OmegaConfBaseException

BASE_KEY = "base"   # top-level recipe key naming a recipe to merge first (path relative to the recipe)

Layer = tuple[str, dict]   # (where it came from, plain nested dict)

# (key, value) of choices that existed once -> why they are gone (appended to the error).
REMOVED_CHOICES = {
    ("data.on_layout_change", "resplit"): " ('resplit' was removed: it only approximated the data "
                                          "position, repeating and skipping documents; see "
                                          "docs/data.md)",
}


def load_config(path: str | os.PathLike | None, overrides: Iterable[str] = ()) -> TrainConfig:
    """Schema defaults <- `base:` chain <- recipe at `path` <- overrides (`train.steps=100`)."""
    if isinstance(overrides, str):
        raise TypeError("overrides must be a list of 'key=value' strings, not one string")
    from omegaconf import OmegaConf
    layers = _recipe_layers(Path(path)) if path is not None else []
    layers += [_override_layer(item) for item in overrides]
    merged = OmegaConf.structured(TrainConfig)
    for source, layer in layers:
        _check_section(layer, TrainConfig, prefix="", source=source)
        merged = _merge(merged, layer, source)
    return _to_object(merged)


def config_to_yaml(cfg: TrainConfig) -> str:
    from omegaconf import OmegaConf
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_resolved_config(cfg: TrainConfig, path: str | os.PathLike) -> Path:
    """Write every key of `cfg` as YAML that `load_config` reads back to an equal config."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "# Resolved tsp_trainer config: every key, after base, recipe and overrides.\n"
    # Write-then-rename so a crash never leaves a half-written config next to a checkpoint.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text + config_to_yaml(cfg))
    os.replace(tmp, path)
    return path


# ---------------------------------------------------------------------------------------------
# Reading layers


def _recipe_layers(path: Path, chain: tuple[Path, ...] = ()) -> list[Layer]:
    """The recipe's `base:` chain, outermost first, then the recipe itself."""
    if path.resolve() in chain:
        names = " -> ".join(str(p) for p in (*chain, path.resolve()))
        raise ValueError(f"config file '{path}' includes itself through '{BASE_KEY}:' ({names})")
    layer = _read_yaml(path, named_by=chain[-1] if chain else None)
    base = layer.pop(BASE_KEY, None)
    if base is None:
        return [(f"in {path}", layer)]
    if not isinstance(base, str):
        raise ValueError(f"config key '{BASE_KEY}'={_show(base)} must be a recipe file name "
                         f"(relative to the recipe); in {path}")
    return _recipe_layers(path.parent / base, (*chain, path.resolve())) + [(f"in {path}", layer)]


def _read_yaml(path: Path, *, named_by: Path | None) -> dict:
    import yaml
    from omegaconf import DictConfig, OmegaConf
    origin = f" (named by '{BASE_KEY}:' in {named_by})" if named_by else ""
    if not path.is_file():
        raise ValueError(f"config file '{path}' does not exist{origin}")
    try:
        conf = OmegaConf.load(path)   # OmegaConf's YAML loader also reads 1e-8 as a float
    except yaml.YAMLError as err:
        raise ValueError(f"config file '{path}' is not valid YAML: {_yaml_problem(err)}") from None
    except UnicodeDecodeError as err:     # a binary file, or text in another encoding
        raise ValueError(f"config file '{path}'{origin} is not UTF-8 text (byte 0x{err.object[err.start]:02x} "
                         f"at offset {err.start}): a recipe is a YAML file") from None
    except OSError:   # OmegaConf.load raises OSError for a top-level scalar
        conf = None
    if not isinstance(conf, DictConfig):
        raise ValueError(f"config file '{path}' must hold a mapping of sections (model:, train:, ...)")
    if len(conf) == 0:   # an empty file would train on the schema defaults, which no one means
        raise ValueError(f"config file '{path}'{origin} is empty (or only comments): it must set at "
                         "least one section (model:, data:, train:, ...) or name a recipe with "
                         f"'{BASE_KEY}:'")
    return OmegaConf.to_container(conf, resolve=False)


def _yaml_problem(err: yaml.YAMLError) -> str:
    """One line from PyYAML's multi-line message: the problem and where."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else problem


def _override_layer(item: str) -> Layer:
    import yaml
    from omegaconf import OmegaConf
    key, sep, _ = item.partition("=")
    if not sep or not key.strip() or "" in key.split("."):
        raise ValueError(f"override '{item}' must look like section.key=value, e.g. train.steps=100")
    try:
        conf = OmegaConf.from_dotlist([item])
    except yaml.YAMLError as err:
        raise ValueError(f"override '{item}' has a value that is not valid YAML: "
                         f"{_yaml_problem(err)}") from None
    return f"from override '{item}'", OmegaConf.to_container(conf, resolve=False)


# ---------------------------------------------------------------------------------------------
# Checking a layer against the schema


def _check_section(layer: dict, cls: type, *, prefix: str, source: str) -> None:
    hints = typing.get_type_hints(cls)
    for key, value in layer.items():
        dotted = f"{prefix}{key}"
        if key not in hints:
            raise ValueError(f"config key '{dotted}' is not a known key ({_key_hint(key, cls, prefix)}); "
                             f"{source}")
        kind = hints[key]
        if dataclasses.is_dataclass(kind):
            if not isinstance(value, dict):
                raise ValueError(f"config key '{dotted}'={_show(value)} must be a section "
                                 f"(a mapping of {kind.__name__} keys); {source}")
            _check_section(value, kind, prefix=dotted + ".", source=source)
        elif list_of_sections(kind) and isinstance(value, list):
            item_cls = typing.get_args(kind)[0]
            for i, item in enumerate(value):
                if not isinstance(item, dict):
                    raise ValueError(f"config key '{dotted}[{i}]'={_show(item)} must be a mapping "
                                     f"of {item_cls.__name__} keys; {source}")
                _check_section(item, item_cls, prefix=f"{dotted}[{i}].", source=source)
        elif not _is_interpolation(value) and not _accepts(value, kind):
            raise ValueError(f"config key '{dotted}'={_show(value)} must be {_describe(kind)}"
                             f"{_bool_trap_hint(value, kind)}{_removed_choice(dotted, value)}"
                             f"; {source}")


def _removed_choice(dotted: str, value: Any) -> str:
    """The hint for a choice an older version took (REMOVED_CHOICES); a list value has none."""
    return REMOVED_CHOICES.get((dotted, value), "") if isinstance(value, typing.Hashable) else ""


def _accepts(value: Any, kind: Any) -> bool:
    """Strict type match. A str field also takes a bare number (`run_name: 2024` is meant as text)."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is list:
        return isinstance(value, list) and all(_accepts(v, args[0]) for v in value)
    if origin is Literal:
        return any(type(value) is type(a) and value == a for a in args)
    if origin in (Union, types.UnionType):
        return any(_accepts(value, a) for a in args)
    if kind is type(None):
        return value is None
    if isinstance(value, bool):   # bool is an int subclass; only a bool field takes it
        return kind is bool
    if kind is float:
        return isinstance(value, (int, float))
    if kind is str:
        return isinstance(value, (str, int, float))
    return isinstance(value, kind)


def _describe(kind: Any) -> str:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is list:
        if dataclasses.is_dataclass(args[0]):
            return f"a list of {args[0].__name__} mappings"
        return f"a list of {_describe(args[0]).split(' ', 1)[-1]}s"       # "a list of strings"
    names = {int: "an int", float: "a number", bool: "a bool (true/false)", str: "a string",
             type(None): "null"}
    return names.get(kind, kind.__name__)


def _bool_trap_hint(value: Any, kind: Any) -> str:
    # YAML 1.1 reads yes/no/on/off as booleans; the user almost always meant the word.
    if isinstance(value, bool) and _accepts("x", kind):
        return " (YAML reads yes/no/on/off/true/false as a bool; quote the word)"
    return ""


def _key_hint(key: Any, cls: type, prefix: str) -> str:
    """'did you mean ...' from the same section first, then any section; else the known keys."""
    name = str(key)
    siblings = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(name, siblings, n=1)
    if close:
        return f"did you mean '{prefix}{close[0]}'?"
    # The key may belong to another section (`train.seq_len` for `data.seq_len`).
    leaves = leaf_keys(TrainConfig)
    close = difflib.get_close_matches(name, [p.rsplit(".", 1)[-1] for p in leaves], n=1)
    if close:
        return f"did you mean '{next(p for p in leaves if p.endswith('.' + close[0]))}'?"
    section = f" of '{prefix[:-1]}'" if prefix else ""
    return f"known keys{section}: {', '.join(siblings)}"


def _is_interpolation(value: Any) -> bool:
    # `${...}` is resolved (and type-checked by OmegaConf) when the object is built.
    return isinstance(value, str) and "${" in value


def _show(value: Any) -> str:
    text = "null" if value is None else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------------------------------------
# Merging and building the dataclasses


def _merge(merged: DictConfig, layer: dict, source: str) -> DictConfig:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException
    try:
        return OmegaConf.merge(merged, layer)
    except OmegaConfBaseException as err:
        raise _translate(err, source) from None


def _to_object(merged: DictConfig) -> TrainConfig:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException
    try:
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:   # interpolations resolve (and can fail) only here
        raw = _raw_value(merged, getattr(err, "full_key", None))
        raise _translate(err, "after merging all layers", value=raw) from None


def _raw_value(merged: DictConfig, key: str | None) -> Any:
    """The unresolved value at `key` (the `${...}` text the user wrote), or None."""
    from omegaconf import OmegaConf
    node: Any = OmegaConf.to_container(merged, resolve=False)
    for part in (key or "").split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _translate(err: OmegaConfBaseException, source: str, *, value: Any = None) -> ValueError:
    """A one-line ValueError from OmegaConf's multi-line message (for what our own check let by)."""
    rule = str(getattr(err, "msg", None) or err).splitlines()[0]
    key = getattr(err, "full_key", None)
    if not key:
        return ValueError(f"config: {rule}; {source}")
    shown = _show(value if value is not None else getattr(err, "value", None))
    return ValueError(f"config key '{key}'={shown}: {rule}; {source}")
