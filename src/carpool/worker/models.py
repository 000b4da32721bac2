"""models.py: model files inside installed PyPI wheels, and the built-in models.

A model's ``[source]`` table (docs/models.md, :class:`~carpool.worker.config.SourceConfig`)
names a file inside a wheel: its distribution, the version pinned, the file's name and its
sha256. The built-in models (``orientation``, ``ppocr-cls``, ``ppocr-det``, ``ppocr-rec``)
are a model repository shipped inside carpool (``carpool/models/<name>/model.toml``,
:mod:`carpool.worker.repository`) whose models name such files. The wheels are installed
with ``--no-deps`` (see the Makefile): we never import them, we only locate their files
through ``importlib.metadata``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from pathlib import Path

from carpool.common.errors import ConfigError
from carpool.worker.config import SourceConfig
from carpool.worker.repository import builtin

DEFAULT_MODEL = "orientation"


def locate_source(source: SourceConfig, what: str, *, verify: bool = False) -> Path:
    """Path of a ``[source]`` file inside its installed wheel.

    Raises:
        ConfigError: wheel not installed, no such file in it, or (with ``verify``) a
            checksum other than the pinned one.
    """
    try:
        files = importlib.metadata.files(source.distribution) or []
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(
            f"{what} needs the wheel {source.distribution}: {source.hint()}"
        ) from None
    for f in files:
        if f.name == source.file:
            path = Path(str(f.locate()))
            if verify and source.sha256 and sha256_of(path) != source.sha256:
                raise ConfigError(f"{path} does not match the pinned sha256 of {what}")
            return path
    raise ConfigError(
        f"{source.distribution} has no {source.file}; reinstall with: {source.hint()}"
    )


def locate(name: str, *, verify: bool = False) -> Path:
    """Path of a built-in model's ONNX file inside its installed wheel.

    Raises:
        ConfigError: unknown name, wheel not installed, or (with ``verify``) wrong checksum.
    """
    models = builtin().models
    model = models.get(name)
    source = None if model is None else model.config.source
    if source is None:
        raise ConfigError(
            f"unknown model {name!r}; the built-in catalogue has {', '.join(models)}; any other "
            "ONNX model is served from its file: carpool worker --model /path/to/model.onnx "
            "(or NAME=/path/to/model.onnx), path = in a [[models]] table of worker.toml, or "
            "a model repository (carpool worker --repository DIR, docs/models.md)"
        )
    return locate_source(source, f"model {name!r}", verify=verify)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
