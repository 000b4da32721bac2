"""repository.py: a model repository — a folder per model, its config beside its file.

Layout (docs/models.md)::

    DIR/<name>/model.toml     the model's config: the keys of a [[models]] table of
                              worker.toml (one schema, ModelConfig); its name is the folder's
    DIR/<name>/model.onnx     its ONNX file (or `path = "other.onnx"`, relative to the
                              folder; or a [source] table naming a file in a wheel)
    DIR/<name>/plans/         its TensorRT plans (the engine cache: carpool build-engine
                              writes them, a worker finds them there)

The built-in models are such a repository, shipped inside carpool (``carpool/models``).
Reading a repository parses every model.toml and resolves file paths; it does not open
the ONNX files (``carpool models check``, :mod:`carpool.worker.modelcheck`, does).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from carpool.common.config import collect, load_toml
from carpool.common.errors import ConfigError
from carpool.worker.config import ModelConfig

MODEL_FILE = "model.toml"
DEFAULT_ONNX = "model.onnx"
#: In each model's folder: its TensorRT plans (worker/tensorrt/cache.py).
PLANS_DIR = "plans"
#: The built-in models' repository, inside the installed package.
BUILTIN_ROOT = Path(__file__).resolve().parent.parent / "models"


@dataclass(frozen=True, slots=True)
class RepoModel:
    """One model of a repository."""

    config: ModelConfig
    toml: Path  # its model.toml
    # model.toml as read, with its name and its file's path resolved: what a [[models]]
    # table naming this model is laid over.
    data: Mapping[str, Any]

    @property
    def name(self) -> str:
        return self.config.name


@dataclass(frozen=True, slots=True)
class Repository:
    root: Path
    models: Mapping[str, RepoModel]  # by name, in the order of their folders' names

    def configs(self) -> dict[str, ModelConfig]:
        return {name: m.config for name, m in self.models.items()}


def scan(root: str | Path) -> tuple[Repository, list[str]]:
    """The models of the repository at ``root`` that parse, and the problems of the rest
    (each ``FILE: KEY: rule``)."""
    root = Path(root)
    if not root.is_dir():
        return Repository(root, {}), [f"{root}: not a folder (a model repository is one)"]
    models: dict[str, RepoModel] = {}
    problems: list[str] = []
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    for folder in folders:
        model, found = _parse(folder)
        problems += found
        if model is not None:
            models[model.name] = model
    if not folders:
        problems.append(f"{root}: no model folders (DIR/<name>/{MODEL_FILE})")
    return Repository(root, models), problems


def _parse(folder: Path) -> tuple[RepoModel | None, list[str]]:
    toml = folder / MODEL_FILE
    if not toml.is_file():
        return None, [f"{folder}: no {MODEL_FILE} (each folder of a repository is one model)"]
    prefix = f"{toml}: "
    try:
        data = load_toml(toml)
    except ConfigError as exc:  # ("config FILE is not valid TOML: ...")
        return None, [prefix + str(exc).replace(f"config {toml} ", "")]
    problems = []
    name = data.get("name", folder.name)
    if name != folder.name:
        problems.append(f"{prefix}name: is {name!r}; a repository's model is named by its folder")
    data["name"] = folder.name
    if data.get("source") is None and data.get("engine", "onnxruntime") != "synthetic":
        path = data.get("path", DEFAULT_ONNX)
        if isinstance(path, str) and path:
            data["path"] = str(folder / path)
    data["folder"] = str(folder)  # (its plans/ holds its TensorRT plans)
    config, found = collect(ModelConfig, data, prefix)
    problems += [p if p.startswith(prefix) else prefix + p for p in found]
    if config is None or problems:
        return None, problems
    return RepoModel(config, toml, data), []


def load(root: str | Path) -> Repository:
    """The repository at ``root``.

    Raises:
        ConfigError: listing every problem of its model.toml files.
    """
    repository, problems = scan(root)
    if problems:
        raise ConfigError(f"model repository {root}:\n  " + "\n  ".join(problems))
    return repository


@functools.cache
def builtin() -> Repository:
    """The built-in models (``carpool/models``)."""
    return load(BUILTIN_ROOT)


def merged(base: Mapping[str, Any], table: Mapping[str, Any]) -> dict[str, Any]:
    """``table``'s keys over ``base``'s; ``inputs`` and ``outputs`` per tensor name,
    ``tensorrt`` per key, and ``path``/``source`` as one key (a table that names a file
    replaces both)."""
    out = dict(base)
    if "path" in table or "source" in table:
        out.pop("path", None)
        out.pop("source", None)
    for key, value in table.items():
        below = out.get(key)
        nested = key in ("inputs", "outputs", "tensorrt")
        if nested and isinstance(value, dict) and isinstance(below, dict):
            out[key] = {**below, **value}
        else:
            out[key] = value
    return out


def worker_models(data: Mapping[str, Any], repository: Repository | None) -> dict[str, Any]:
    """worker.toml's ``data`` with its models taken from ``repository``: each
    ``[[models]]`` table that names one of its models (and neither path nor source) laid
    over that model's model.toml, or, with no ``[[models]]``, every model in it."""
    if repository is None:
        return dict(data)
    tables = data.get("models")
    if tables is None:
        return {**data, "models": [dict(m.data) for m in repository.models.values()]}
    if not isinstance(tables, list):
        return dict(data)  # (from_mapping reports it)
    out: list[Any] = []
    for table in tables:
        model = repository.models.get(str(table.get("name"))) if isinstance(table, dict) else None
        if model is None or "path" in table or "source" in table:
            out.append(table)
        else:
            out.append(merged(model.data, table))
    return {**data, "models": out}
