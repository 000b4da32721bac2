"""modelcheck.py: ``carpool models check`` and ``list`` — a repository against its files.

:func:`check` goes further than reading a repository (:func:`repository.scan`): for each
model it finds the ONNX file (a ``[source]`` wheel installed at the pinned version, the
file's sha256), reads its real inputs and outputs with ONNX Runtime (or, without it,
the ``onnx`` package), and checks the
model's shape declarations against them (:func:`carpool.worker.shapes.problems`). Each
problem reads ``FILE: KEY: rule``. :func:`describe` is one model as ``list`` shows it.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from carpool.common.errors import ConfigError
from carpool.common.padding import CropAxis, PadRule
from carpool.common.protocol import DTYPES, TensorMeta
from carpool.common.shape_rules import ShapeRule
from carpool.worker.config import ModelConfig
from carpool.worker.engines.ort import read_io
from carpool.worker.models import locate_source, sha256_of
from carpool.worker.repository import RepoModel, Repository, scan
from carpool.worker.shapes import problems as shape_problems


@dataclass(frozen=True, slots=True)
class ModelIO:
    """A model's file and the inputs and outputs read from it (empty when unread)."""

    file: str
    inputs: tuple[TensorMeta, ...] = ()
    outputs: tuple[TensorMeta, ...] = ()


def check(root: str | Path) -> tuple[Repository, list[str]]:
    """The repository at ``root`` and every problem found in it (empty: none)."""
    repository, problems = scan(root)
    for model in repository.models.values():
        problems += model_problems(model)[1]
    return repository, problems


def model_problems(model: RepoModel) -> tuple[ModelIO, list[str]]:
    """One model's file, inputs and outputs, and its problems against them."""
    prefix = f"{model.toml}: "
    config = model.config
    found: list[tuple[str, str]] = []
    if "engine" in model.data and config.backends and config.engine not in config.backends:
        found.append(
            ("engine", f"{config.engine} is not one of its backends {list(config.backends)}")
        )
    io, file_problems = read(config)
    found += file_problems
    if io.inputs:
        found += shape_problems(config.shapes(), io.inputs, io.outputs, config.max_batch)
    return io, [f"{prefix}{key}: {rule}" for key, rule in found]


def read(config: ModelConfig) -> tuple[ModelIO, list[tuple[str, str]]]:
    """A model's file and its inputs and outputs, or the (key, rule) of what stops that."""
    if config.engine == "synthetic":
        from carpool.worker.engines.synthetic import SyntheticEngine

        info = SyntheticEngine(item_shape=config.item_shape, dtype=config.dtype).info
        return ModelIO("(synthetic)", info.io.inputs, info.io.outputs), []
    source = config.source
    if source is not None:
        key = "source"
        try:
            installed = importlib.metadata.version(source.distribution)
        except importlib.metadata.PackageNotFoundError:
            return ModelIO(source.file), [
                (key, f"{source.distribution} is not installed: {source.hint()}")
            ]
        if installed != source.version:
            problem = f"{source.version} is pinned, {installed} is installed: {source.hint()}"
            return ModelIO(source.file), [("source.version", problem)]
        try:
            path = locate_source(source, f"model {config.name!r}")
        except ConfigError as exc:
            return ModelIO(source.file), [("source.file", str(exc))]
        if source.sha256 and (digest := sha256_of(path)) != source.sha256:
            return ModelIO(str(path)), [("source.sha256", f"{path} has sha256 {digest}")]
    else:
        key = "path"
        path = Path(config.path)
        if not path.is_file():
            return ModelIO(str(path)), [(key, f"no ONNX file {path}")]
    try:
        try:
            inputs, outputs = read_io(path)
        except ImportError:  # (a TensorRT host without onnxruntime)
            inputs, outputs = read_with_onnx(path)
    except ImportError:
        problem = "inputs and outputs not read: neither onnxruntime nor onnx is installed"
        return ModelIO(str(path)), [(key, problem)]
    except ConfigError as exc:
        return ModelIO(str(path)), [(key, str(exc))]
    return ModelIO(str(path), inputs, outputs), []


def read_with_onnx(path: str | Path) -> tuple[tuple[TensorMeta, ...], tuple[TensorMeta, ...]]:
    """An ONNX file's inputs and outputs read with the ``onnx`` package, where
    onnxruntime is missing (its graph inputs that are initializers are not inputs).

    Raises:
        ImportError: no onnx package.
        ConfigError: the file cannot be read, or has a tensor carpool cannot serve.
    """
    import onnx
    from onnx.helper import tensor_dtype_to_np_dtype

    try:
        graph = onnx.load(str(path), load_external_data=False).graph
    except Exception as exc:  # protobuf's DecodeError, an OSError, ...
        raise ConfigError(f"cannot load ONNX model {path}: {exc}") from None

    def meta(value: onnx.ValueInfoProto, what: str) -> TensorMeta:
        tensor = value.type.tensor_type
        try:
            dtype = tensor_dtype_to_np_dtype(tensor.elem_type).name
        except KeyError:
            dtype = ""
        if dtype not in DTYPES:
            raise ConfigError(f"{path}: {what} {value.name!r} has unsupported type {dtype}")
        dims = tuple(d.dim_value if d.dim_value > 0 else -1 for d in tensor.shape.dim)
        if not dims:
            raise ConfigError(f"{path}: {what} {value.name!r} has no dims")
        return TensorMeta(value.name, dtype, dims)

    initializers = {i.name for i in graph.initializer}
    inputs = tuple(meta(v, "input") for v in graph.input if v.name not in initializers)
    return inputs, tuple(meta(v, "output") for v in graph.output)


def describe(model: RepoModel) -> tuple[list[str], list[str]]:
    """One model as ``carpool models list`` prints it, and its problems."""
    config = model.config
    io, problems = model_problems(model)
    source = config.source
    where = f"{source.distribution}=={source.version} {source.file}" if source else io.file
    lines = [
        f"{config.name}: {config.description}".rstrip(": "),
        f"  backends   {', '.join(config.backends) or 'any'}",
        f"  max_batch  {config.max_batch}"
        + (f" (preferred {list(config.preferred_batch)})" if config.preferred_batch else ""),
        f"  file       {where}",
    ]
    inputs = []
    for t in io.inputs:
        declared = config.inputs.get(t.name)
        rule = None if declared is None else declared.rule()
        inputs.append((t, rule or None, None if declared is None else declared.pad))
    outputs = []
    for t in io.outputs:
        crops = config.outputs.get(t.name)
        outputs.append((t, () if crops is None else tuple(c.crop_axis() for c in crops.crop)))
    lines += io_lines(inputs, outputs)
    if config.warmup:
        lines.append(f"  warmup     {_runs(config)}")
    return lines, problems


def _runs(config: ModelConfig) -> dict[str, list[list[int]]]:
    return {name: [list(s) for s in shapes] for name, shapes in config.warmup.items()}


def io_lines(
    inputs: Iterable[tuple[TensorMeta, ShapeRule | None, PadRule | None]],
    outputs: Iterable[tuple[TensorMeta, Sequence[CropAxis]]],
) -> list[str]:
    """A model's inputs (with their shape rule and buckets) and outputs (with the axes
    they are cropped on), a line each, as ``carpool models list`` and ``show`` print
    them."""
    lines = []
    for t, rule, pad in inputs:
        line = f"  input      {t.name} {t.dtype} {_dims(t.shape)}"
        if rule:
            line += f"  rule {rule.to_wire()}"
        if pad is not None:
            line += f"  buckets: {pad.allowed()}"
        lines.append(line)
    for t, crop in outputs:
        line = f"  output     {t.name} {t.dtype} {_dims(t.shape)}"
        if crop:
            line += "  crop " + ", ".join(
                f"axis {c.axis} = {c.input}[{c.input_axis}]×{c.numerator}/{c.denominator}"
                for c in crop
            )
        lines.append(line)
    return lines


def _dims(shape: tuple[int, ...]) -> str:
    """A shape with its batch dim as B and other dynamic dims as ?."""
    return (
        "["
        + ", ".join("B" if i == 0 else "?" if d == -1 else str(d) for i, d in enumerate(shape))
        + "]"
    )
