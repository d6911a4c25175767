"""Turn plain YAML values into typed dataclass sections, strictly, with errors that name the key.

Supported annotations: int, float (ints accepted), bool (only true/false), str, Optional[T],
Literal[...] (the choices are named in the error), list[T] and nested dataclass sections.
"""
from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Literal, Union

from .errors import ConfigError, suggest
from .fields import is_required


@functools.lru_cache(maxsize=None)
def section_types(cls: type) -> dict[str, Any]:
    """Field name -> resolved annotation for a dataclass section."""
    return typing.get_type_hints(cls)


def section_fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(str(a).lower() if isinstance(a, bool) else repr(a) for a in args)  # YAML spelling
    if origin in (Union, types.UnionType):
        names = [type_name(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in args else "")
    if origin is list:
        return f"a list of {type_name(args[0])}" if args else "a list"
    if dataclasses.is_dataclass(tp):
        return f"a section ({tp.__name__})"
    if tp is bool:
        return "bool (true or false)"
    return getattr(tp, "__name__", str(tp))


def _wrong(key: str, tp: Any, value: Any) -> ConfigError:
    shown = f"{type(value).__name__} {value!r}" if value is not None else "null"
    return ConfigError(f"{key}: expected {type_name(tp)}, got {shown}")


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Return `value` as type `tp` or raise ConfigError naming `key`, the expected type and the value."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        for option in options:
            try:
                return coerce(value, option, key)
            except ConfigError:
                if len(options) == 1:
                    break
        raise _wrong(key, tp, value)
    if origin is Literal:
        for choice in args:
            if type(value) is type(choice) and value == choice:
                return value
        hint = suggest(value, args) if isinstance(value, str) else ""
        raise ConfigError(f"{key}: expected {type_name(tp)}, got {value!r}.{hint}".rstrip("."))
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise _wrong(key, tp, value)
        item = args[0] if args else Any
        return [coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return build_section(tp, section_to_dict(value), key)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a section (a mapping of keys to values), got {type(value).__name__} {value!r}")
        return build_section(tp, value, key)
    if tp is bool:
        if type(value) is bool:
            return value
        raise _wrong(key, tp, value)
    if tp is int:
        if type(value) is int:
            return value
        raise _wrong(key, tp, value)
    if tp is float:
        if type(value) in (int, float):
            return float(value)
        raise _wrong(key, tp, value)
    if tp is str:
        if isinstance(value, str):
            return value
        raise _wrong(key, tp, value)
    raise TypeError(f"config field {key} has an unsupported annotation {tp!r}")  # a schema bug, not user input


def unknown_key_error(key: str, cls: type, prefix: str) -> ConfigError:
    valid = list(section_fields(cls))
    where = f"section '{prefix}'" if prefix else "the top level"
    return ConfigError(
        f"unknown key '{key}' in {where}.{suggest(key, valid)} Valid keys in {where}: {', '.join(valid)}"
    )


def build_section(cls: type, data: dict, prefix: str = "") -> Any:
    """A dataclass `cls` from a mapping; missing keys take their defaults, unknown keys are errors."""
    fields = section_fields(cls)
    hints = section_types(cls)
    kwargs = {}
    for key, value in data.items():
        if not isinstance(key, str) or key not in fields:
            raise unknown_key_error(str(key), cls, prefix)
        kwargs[key] = coerce(value, hints[key], f"{prefix}.{key}" if prefix else key)
    return cls(**kwargs)


def section_to_dict(obj: Any) -> dict:
    """Plain nested dict of a section (lists copied), in field order."""
    return dataclasses.asdict(obj)


def missing_required(obj: Any, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted key, doc) for every required field still None, depth first."""
    out = []
    for f in dataclasses.fields(obj):
        key = f"{prefix}.{f.name}" if prefix else f.name
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out.extend(missing_required(value, key))
        elif is_required(f) and value is None:
            out.append((key, str(f.metadata.get("doc", ""))))
    return out
