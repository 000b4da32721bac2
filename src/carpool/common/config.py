"""config.py: TOML files into frozen dataclasses, with every problem reported at once.

Pure apart from reading the file it is given. Only entry points (cli) read the environment.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from carpool.common.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - JetPack 6 ships Python 3.10
    import tomli as tomllib

T = TypeVar("T")

#: The largest B_max a broker may be configured with, and so the limit a worker announces
#: for an engine that takes any batch (an ONNX model with a symbolic batch dim): the
#: broker's cap then binds, not a worker default nobody chose.
MAX_BATCH_CEILING = 4096


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML file; a missing, non-UTF-8 or malformed file is a ConfigError."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:  # TOML is UTF-8 (a Latin-1 comment, a binary file)
        raise ConfigError(
            f"config {path} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
            f"{exc.start})"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config {path} is not valid TOML: {exc}") from None


def from_mapping(cls: type[T], data: Mapping[str, Any], where: str = "") -> T:
    """Build dataclass ``cls`` from a mapping, checking names and types of every field.

    Nested dataclasses are built from nested tables; ``dict[str, X]`` fields from tables of
    tables. Unknown keys and wrong types are collected and raised together.
    """
    obj, problems = collect(cls, data, where or cls.__name__)
    if obj is None:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))
    return obj


def collect(cls: type[T], data: Mapping[str, Any], where: str) -> tuple[T | None, list[str]]:
    """:func:`from_mapping` that returns its problems, with the object (None when there
    are any). Each problem starts with ``where`` and the key: ``where.key: ...``, or, for a
    ``where`` that ends in ``": "`` (a file's name), ``where`` then the key."""
    problems: list[str] = []
    obj = _build(cls, data, where, problems)
    if problems or obj is _INVALID:
        return None, problems
    return typing.cast(T, obj), problems


def _at(where: str, key: str) -> str:
    return f"{where}{key}" if where.endswith(": ") else f"{where}.{key}"


def _build(cls: Any, data: Any, where: str, problems: list[str]) -> Any:
    if not isinstance(data, Mapping):
        problems.append(f"{where}: expected a table")
        return _INVALID
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            problems.append(f"{_at(where, key)}: unknown setting (known: {', '.join(fields)})")
            continue
        converted = _convert(hints[key], value, _at(where, key), problems)
        if converted is not _INVALID:
            kwargs[key] = converted
    if any(v is _INVALID for v in kwargs.values()):
        return _INVALID  # a nested problem is already reported; build nothing from it
    missing = [
        name
        for name, f in fields.items()
        if f.init
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
        and name not in data
    ]
    if missing:
        problems += [f"{_at(where, name)}: missing (it has no default)" for name in missing]
        return _INVALID
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        problems.append(str(exc))
    except TypeError as exc:
        problems.append(f"{where}: {exc}")
    return _INVALID


_INVALID = object()


def _convert(hint: Any, value: Any, where: str, problems: list[str]) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, where, problems)
    if origin in (dict, Mapping) or hint is dict:
        _, value_hint = typing.get_args(hint)
        if not isinstance(value, Mapping):
            problems.append(f"{where}: expected a table")
            return _INVALID
        table = {k: _convert(value_hint, v, f"{where}.{k}", problems) for k, v in value.items()}
        return _INVALID if any(v is _INVALID for v in table.values()) else table
    if origin in (tuple, list):
        (item_hint, *_) = typing.get_args(hint)
        if not isinstance(value, list):
            problems.append(f"{where}: expected a list")
            return _INVALID
        items = tuple(
            _convert(item_hint, v, f"{where}[{i}]", problems) for i, v in enumerate(value)
        )
        return _INVALID if any(v is _INVALID for v in items) else items
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _convert(args[0], value, where, problems) if len(args) == 1 else value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(hint, type) and (
        not isinstance(value, hint) or (hint is int and isinstance(value, bool))
    ):
        problems.append(f"{where}: expected {hint.__name__}, got {type(value).__name__}")
        return _INVALID
    return value


def out_of_range(obj: object, bounds: Mapping[str, tuple[float, float]]) -> list[str]:
    """ "NAME must be in LOW..HIGH" for each field of ``obj`` named in ``bounds`` whose value
    lies outside its (inclusive) bounds, in the order of ``bounds``."""
    return [
        f"{name} must be in {low}..{high}"
        for name, (low, high) in bounds.items()
        if not low <= getattr(obj, name) <= high
    ]


def signs(obj: object, positive: Sequence[str] = (), non_negative: Sequence[str] = ()) -> list[str]:
    """ "NAME must be > 0, got VALUE" for each field of ``obj`` named in ``positive`` that
    is not (NaN included), then "NAME must be >= 0, got VALUE" for each one named in
    ``non_negative`` below 0, each in the order given."""
    problems = [
        f"{name} must be > 0, got {value}"
        for name in positive
        if not (value := getattr(obj, name)) > 0
    ]
    problems += [
        f"{name} must be >= 0, got {value}"
        for name in non_negative
        if (value := getattr(obj, name)) < 0
    ]
    return problems


def check(problems: list[str], where: str) -> None:
    """Raise a ConfigError listing ``problems`` (for ``__post_init__`` validation)."""
    if problems:
        raise ConfigError(f"{where}: " + "; ".join(problems))
