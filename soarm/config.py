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
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: '{key}' must be a string, got {value!r}")
        return value
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
