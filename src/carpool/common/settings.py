"""settings.py: a role's settings from its file, then the environment, then flags.

Every setting of a role's config dataclass (``BrokerConfig``, ``WorkerConfig``) has an
environment variable whose name is generated from the dataclass: ``CARPOOL_<ROLE>_<KEY>``
for a top-level key, ``CARPOOL_<ROLE>_<SECTION>_<KEY>`` for a key of a section (a nested
dataclass, a TOML table): ``CARPOOL_BROKER_BATCHING_MAX_BATCH``. The same keys, dotted as
in TOML, go in ``--set KEY=VALUE`` (``--set batching.max_batch=16``). A value is the text
itself for a string setting, else a TOML value (``16``, ``0.005``, ``true``, ``0o640``,
``["CUDAExecutionProvider"]``, ``[{name = "orientation", max_batch = 16}]``). The
layers are merged into the file's mapping, which ``from_mapping`` then checks as a whole,
so a bad value from any layer is reported by its key and rule.

A ``CARPOOL_*`` variable that no role and no process setting knows is an error when it
looks meant as one (:func:`check_variables`: a role's prefix, a near name, a key without
its role and section): a misspelt name would otherwise be ignored. Any other
(``CARPOOL_HOME``, a user's own script's) is the user's, and left alone. Pure apart from
the mapping of variables it is given; only entry points pass ``os.environ``.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from carpool.common.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - JetPack 6 ships Python 3.10
    import tomli as tomllib

PREFIX = "CARPOOL_"

#: Variables of the process rather than of a role's config, by name: what each does.
PROCESS_VARIABLES: dict[str, str] = {
    "CARPOOL_LOG_LEVEL": "log level of every command (--log-level)",
    "CARPOOL_MALLOC_TUNING": "0: leave glibc's allocator settings alone (common/memory.py)",
    "CARPOOL_WEDGE_FILE": "while this file exists the main loop blocks (watchdog drill)",
}

#: Older names, kept: (role, variable) → the key it sets.
ALIASES: dict[tuple[str, str], tuple[str, ...]] = {
    ("broker", "CARPOOL_FRONTEND"): ("frontend",),
    ("broker", "CARPOOL_BACKEND"): ("backend",),
    ("broker", "CARPOOL_LOCAL_BACKEND"): ("local_backend",),
    ("worker", "CARPOOL_BROKER"): ("broker",),
}

Path = tuple[str, ...]


def setting_paths(cls: type) -> dict[Path, Any]:
    """Every setting of dataclass ``cls`` as its key path, with its type: the fields of
    nested dataclasses (sections) by their section's path, every other field whole."""
    out: dict[Path, Any] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint) and isinstance(hint, type):
            out.update({(f.name, *p): h for p, h in setting_paths(hint).items()})
        else:
            out[(f.name,)] = hint
    return out


def variable(role: str, path: Path) -> str:
    """The environment variable of setting ``path`` of ``role``."""
    return PREFIX + "_".join((role, *path)).upper()


def variables(role: str, cls: type) -> dict[str, Path]:
    """``role``'s environment variables (its aliases included), each with its key path."""
    names = {variable(role, p): p for p in setting_paths(cls)}
    names.update({name: path for (r, name), path in ALIASES.items() if r == role})
    return names


#: How near (``difflib`` ratio) the part after ``CARPOOL_`` of a name must be to a known
#: name's to be taken for a misspelling of it: ``LOGLEVEL`` is 0.94 of ``LOG_LEVEL``,
#: while ``VENV`` is 0.36 of ``BACKEND`` and ``PROTOCOL_DOC`` 0.44 of ``LOCAL_BACKEND``.
NEAR_RATIO = 0.8


def check_variables(
    environ: Mapping[str, str], known: Iterable[str], roles: Iterable[str]
) -> list[str]:
    """Refuse the ``CARPOOL_*`` variables of ``environ`` that look meant as a setting but
    are not ``known`` (nor process variables), each named with the setting it was
    probably meant as. A name looks meant as a setting when

    - it begins with a role's prefix (``CARPOOL_BROKER_`` for role ``broker``),
    - its part after ``CARPOOL_`` is within ``NEAR_RATIO`` of a known name's
      (``CARPOOL_LOGLEVEL``), or
    - a known name ends with ``_`` and that part: a key without its role and section
      (``CARPOOL_MAX_BATCH``).

    Returns:
        The other unknown ``CARPOOL_*`` names, sorted (for the caller to warn of).

    Raises:
        ConfigError: naming every refused variable.
    """
    names = set(known) | set(PROCESS_VARIABLES)
    prefixes = [f"{PREFIX}{role.upper()}_" for role in roles]
    refused, others = [], []
    for name in sorted(k for k in environ if k.startswith(PREFIX) and k not in names):
        meant = _meant(name, names, prefixes)
        if meant is None:
            others.append(name)
            continue
        hint = f" (did you mean {' or '.join(meant)}?)" if meant else ""
        refused.append(f"{name}: unknown carpool environment variable{hint}")
    if refused:
        raise ConfigError("\n  ".join(["unknown environment variables:", *refused]))
    return others


def _meant(name: str, names: set[str], prefixes: Iterable[str]) -> list[str] | None:
    """The known ``names`` that unknown ``name`` was probably meant as ([] when none is
    near), or None when it does not look meant as a setting (check_variables' rules)."""
    tail = name.removeprefix(PREFIX)
    # A key without its role and section (CARPOOL_MAX_BATCH): the names that end so.
    ends = sorted(n for n in names if n.endswith("_" + tail))
    if ends:
        return ends[:3]
    by_tail = {n.removeprefix(PREFIX): n for n in names}
    near = difflib.get_close_matches(tail, sorted(by_tail), n=1, cutoff=NEAR_RATIO)
    if near:
        return [by_tail[near[0]]]
    for prefix in prefixes:
        if name.startswith(prefix):
            own = sorted(n for n in names if n.startswith(prefix))
            return _nearest_key(name.removeprefix(prefix), own, prefix)
    return None


def _nearest_key(key: str, own: Sequence[str], prefix: str) -> list[str]:
    """The name of ``own`` whose key (after ``prefix``), or the key's end past a ``_``,
    is nearest ``key``: ``MAX_BACH`` is BATCHING_MAX_BATCH's ``MAX_BATCH``. [] when none
    is above difflib's default cutoff (0.6)."""
    best, best_ratio = "", 0.6
    for name in own:
        parts = name.removeprefix(prefix).split("_")
        for i in range(len(parts)):
            ratio = difflib.SequenceMatcher(None, key, "_".join(parts[i:])).ratio()
            if ratio > best_ratio:
                best, best_ratio = name, ratio
    return [best] if best else []


def parse_value(hint: Any, text: str, name: str) -> Any:
    """The value of setting text ``text`` for a field typed ``hint`` (``name`` for errors):
    the text for a string, else a TOML value."""
    if _is_str(hint):
        return text
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        raise ConfigError(
            f"{name}={text!r}: not a TOML value (a number, true/false, [a list], {{a table}})"
        ) from None


def _is_str(hint: Any) -> bool:
    """``str``, or ``str | None``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(hint) if a is not type(None)] == [str]
    return hint is str


def put(data: Mapping[str, Any], path: Path, value: Any) -> dict[str, Any]:
    """``data`` with ``value`` at ``path`` (tables on the way copied, made if missing)."""
    out = dict(data)
    head, *rest = path
    if rest:
        inner = out.get(head)
        out[head] = put(inner if isinstance(inner, Mapping) else {}, tuple(rest), value)
    else:
        out[head] = value
    return out


@dataclasses.dataclass
class Layers:
    """What the environment and flags set over a role's file, for the error message."""

    given: list[str] = dataclasses.field(default_factory=list)

    def note(self) -> str:
        return "" if not self.given else "\n  (set by: " + ", ".join(self.given) + ")"


def from_environment(
    data: Mapping[str, Any],
    role: str,
    cls: type,
    environ: Mapping[str, str],
    layers: Layers | None = None,
) -> dict[str, Any]:
    """``data`` (a role's file) with ``role``'s variables of ``environ`` over it."""
    hints = setting_paths(cls)
    out = dict(data)
    for name, path in variables(role, cls).items():
        if name in environ:
            out = put(out, path, parse_value(hints[path], environ[name], name))
            if layers is not None:
                layers.given.append(name)
    return out


def from_flags(
    data: Mapping[str, Any], cls: type, pairs: Sequence[str], layers: Layers | None = None
) -> dict[str, Any]:
    """``data`` with ``--set KEY=VALUE`` ``pairs`` over it (KEY dotted: ``batching.max_batch``).

    Raises:
        ConfigError: a pair without ``=``, or a key the role does not have.
    """
    hints = setting_paths(cls)
    out = dict(data)
    for pair in pairs:
        key, sep, text = pair.partition("=")
        path = tuple(key.strip().split("."))
        if not sep or path not in hints:
            known = sorted(".".join(p) for p in hints)
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(f"--set {pair}: expected KEY=VALUE with a setting KEY{hint}")
        out = put(out, path, parse_value(hints[path], text, f"--set {key}"))
        if layers is not None:
            layers.given.append(f"--set {key}")
    return out
