"""Typed configuration: dataclasses loaded from YAML, validated once at the edge.

Every config class is a plain dataclass. `load(cls, path)` reads YAML, rejects unknown
or mistyped keys with the file and the dotted key named, and fills defaults for keys
left out. Nested dataclasses nest in YAML.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file that cannot be used; the message is one line naming file and key."""


def load(cls: type[T], path: str | Path, overrides: dict[str, Any] | None = None) -> T:
    """Load `path` into dataclass `cls`; `overrides` maps dotted keys to values."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}:{where} malformed YAML ({getattr(e, 'problem', e)})") from None
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(raw).__name__}")
    for key, value in (overrides or {}).items():
        _set_dotted(raw, key, value)
    return from_dict(cls, raw, str(path))


def from_dict(cls: type[T], raw: dict, where: str = "<dict>", prefix: str = "") -> T:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: '{prefix.rstrip('.') or '<root>'}' must be a mapping")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown key '{prefix}{unknown[0]}' (known: {', '.join(sorted(fields))})")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in raw.items():
        kwargs[name] = _convert(hints[name], value, where, prefix + name)
    try:
        obj = cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{where}: {prefix or 'config'}: {e}") from None
    check = getattr(obj, "validate", None)
    if check is not None:
        try:
            check()
        except ValueError as e:
            raise ConfigError(f"{where}: {prefix}{e}") from None
    return obj


def _convert(tp: Any, value: Any, where: str, key: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where, key + ".")
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, where, key)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: '{key}' must be a list, got {type(value).__name__}")
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        items = [_convert(item_tp, v, where, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: '{key}' must be a mapping")
        _, val_tp = typing.get_args(tp)
        return {k: _convert(val_tp, v, where, f"{key}.{k}") for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: '{key}' must be a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: '{key}' must be an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: '{key}' must be true or false, got {value!r}")
        return value
    if tp in (str, Path):
        if not isinstance(value, (str, Path)):
            raise ConfigError(f"{where}: '{key}' must be a string, got {value!r}")
        return tp(value)
    return value


def _set_dotted(raw: dict, key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = raw
    for i, p in enumerate(parents):
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: '{'.'.join(parents[:i + 1])}' is {node!r}, not a section with keys")
    node[leaf] = value


def dump(obj: Any, path: str | Path) -> Path:
    """Write dataclass `obj` as YAML that `load` reads back into the same config (atomically)."""
    from soarm.files import atomic_write

    plain = json.loads(json.dumps(dataclasses.asdict(obj)))      # tuples -> lists: safe YAML
    return atomic_write(path, lambda tmp: tmp.write_text(yaml.safe_dump(plain, sort_keys=False)))


# ---------------------------------------------------------------- command-line flags
def add_flags(parser, cls: type, prefix: str = "", skip: tuple[str, ...] = (), flag_prefix: str | None = None) -> None:
    """One flag per field of config dataclass `cls` (nested ones dotted: --search.population),
    typed as the field, its help the comment beside the field in the source. Every flag
    defaults to None: `flag_overrides` returns only the flags given, so the config's own
    defaults and files stay the one source of values. `prefix` goes before each key
    (`run.` -> overrides of `run.iterations`), `flag_prefix` before each flag (default: the same)."""
    flag_prefix = prefix if flag_prefix is None else flag_prefix
    import argparse

    hints, notes = typing.get_type_hints(cls), _field_comments(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or f.name.startswith("_"):
            continue
        tp, key = hints[f.name], prefix + f.name
        if dataclasses.is_dataclass(tp):
            add_flags(parser, tp, key + ".", skip, flag_prefix + f.name + ".")
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        help_text = f"{notes.get(f.name, '')} (default: {default})".strip()
        flag = "--" + (flag_prefix + f.name).replace("_", "-")
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        base = inner[0] if typing.get_origin(tp) in (typing.Union, types.UnionType) else tp
        origin = typing.get_origin(base)
        if base is bool:
            parser.add_argument(flag, dest=key, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif origin in (list, tuple):
            args = typing.get_args(base)
            item = args[0] if args else str
            nargs = len(args) if origin is tuple and args and args[-1] is not Ellipsis else "+"
            parser.add_argument(flag, dest=key, type=_parse(item), nargs=nargs, default=None, help=help_text,
                                metavar=f.name.upper())
        elif base in (int, float, str, Path):
            parser.add_argument(flag, dest=key, type=_parse(base), default=None, help=help_text,
                                metavar=f.name.upper())


def flag_overrides(args, cls: type, prefix: str = "") -> dict[str, Any]:
    """{dotted key: value} of the flags `add_flags(parser, cls, prefix)` made that were given."""
    out = {}
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            out.update(flag_overrides(args, tp, key + "."))
        elif getattr(args, key, None) is not None:
            value = getattr(args, key)
            out[key] = list(value) if isinstance(value, tuple) else value
    return out


def from_flags(cls: type[T], args, base: T | None = None) -> T:
    """A validated `cls` from the defaults (or `base`) and the flags given (ConfigError: one line)."""
    raw = json.loads(json.dumps(dataclasses.asdict(base if base is not None else cls()), default=str))
    for key, value in flag_overrides(args, cls).items():
        _set_dotted(raw, key, str(value) if isinstance(value, Path) else value)
    return from_dict(cls, raw, "command line")


def _parse(tp):
    if tp is int:
        return lambda x: int(x, 0)
    return tp


def _field_comments(cls: type) -> dict[str, str]:
    """The comment on the line of each field's definition in `cls`'s source (Isaac Lab style:
    a unit and a word beside every constant)."""
    import inspect
    import re

    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    out = {}
    for line in source.splitlines():
        m = re.match(r"\s+(\w+)\s*:[^#]*#\s*(.+)$", line)
        if m:
            out.setdefault(m.group(1), m.group(2).strip())
    return out
