"""ort.py: OnnxRuntimeEngine — an ONNX model on ONNX Runtime (its CPU execution provider
by default; others, such as CUDA's in an onnxruntime-gpu install, when configured).

The only importer of onnxruntime. Symbolic dims become ``-1`` in the spec; dim 0 must be
symbolic (the batch). One inference session per engine, one intra-op thread by default: on a shared
edge CPU, concurrency comes from workers, not from threads fighting over cores.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from carpool.common.errors import ConfigError
from carpool.common.protocol import TensorMeta
from carpool.common.shape_rules import ShapeRule
from carpool.worker.engines.base import Array, BadInput, EngineInfo, engine_io, with_rules
from carpool.worker.shapes import ModelShapes, declare

_ORT_TYPES = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(double)": "float64",
    "tensor(int8)": "int8",
    "tensor(uint8)": "uint8",
    "tensor(int16)": "int16",
    "tensor(uint16)": "uint16",
    "tensor(int32)": "int32",
    "tensor(uint32)": "uint32",
    "tensor(int64)": "int64",
    "tensor(uint64)": "uint64",
    "tensor(bool)": "bool",
}


def _tensor(arg: Any, what: str, path: str | Path) -> TensorMeta:
    dtype = _ORT_TYPES.get(arg.type)
    if dtype is None:
        raise ConfigError(f"{path}: {what} {arg.name!r} has unsupported type {arg.type}")
    dims = tuple(d if isinstance(d, int) and d > 0 else -1 for d in arg.shape or ())
    if not dims:
        raise ConfigError(
            f"{path}: {what} {arg.name!r} has no dims (a scalar, or a shape the file does "
            "not declare); carpool batches along dim 0"
        )
    return TensorMeta(arg.name, dtype, dims)


def read_io(path: str | Path) -> tuple[tuple[TensorMeta, ...], tuple[TensorMeta, ...]]:
    """The inputs and outputs of an ONNX file as an engine of it would announce them
    (``carpool models check``); the graph is loaded without optimisation.

    Raises:
        ConfigError: the file cannot be loaded, or has a tensor carpool cannot serve.
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    try:
        loaded = ort.InferenceSession(
            str(path), sess_options=options, providers=["CPUExecutionProvider"]
        )
    except Exception as exc:  # ORT raises its own untyped exception classes
        raise ConfigError(f"cannot load ONNX model {path}: {_first_line(exc)}") from None
    inputs = tuple(_tensor(a, "input", path) for a in loaded.get_inputs())
    outputs = tuple(_tensor(a, "output", path) for a in loaded.get_outputs())
    return inputs, outputs


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip() or type(exc).__name__).splitlines()[0][:300]


class OnnxRuntimeEngine:
    """Runs an ONNX model with onnxruntime on the CPU.

    Args:
        path: the .onnx file.
        max_batch: largest batch to accept (dim 0 must be symbolic).
        intra_op_threads: threads per operator; 1 suits a shared 2-core edge box.
        preferred_batch: sizes to advertise to the broker.
        providers: ONNX Runtime execution providers in order of preference, e.g.
            ``("CUDAExecutionProvider", "CPUExecutionProvider")`` with onnxruntime-gpu;
            each must be one this onnxruntime has (a ConfigError lists those).
        shape_rules: limits on inputs' dynamic dims, by input name, announced to the
            broker (protocol §8.1): e.g. multiples of 32 for a detector's H and W.
        shapes: a model config's shape declarations (shape and pad rules, crops, warm-up
            shapes: :mod:`carpool.worker.shapes`), checked against the file's inputs and
            outputs; a shape rule here replaces one of ``shape_rules`` for that input.
    """

    #: May be called from any one thread at a time (not bound to the thread that built it).
    thread_bound = False

    def __init__(
        self,
        path: str | Path,
        *,
        max_batch: int = 8,
        intra_op_threads: int = 1,
        preferred_batch: Sequence[int] = (),
        providers: Sequence[str] = ("CPUExecutionProvider",),
        shape_rules: Mapping[str, ShapeRule] | None = None,
        shapes: ModelShapes | None = None,
    ) -> None:
        import onnxruntime as ort

        available = ort.get_available_providers()
        missing = [p for p in providers if p not in available]
        if not providers or missing:
            raise ConfigError(
                f"ONNX Runtime execution providers {missing or list(providers)} are not "
                f"available here; this onnxruntime has {', '.join(available)} (a GPU needs "
                "the onnxruntime-gpu package and its CUDA libraries)"
            )

        options = ort.SessionOptions()
        options.intra_op_num_threads = intra_op_threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.log_severity_level = 3
        try:
            self._session = ort.InferenceSession(
                str(path), sess_options=options, providers=list(providers)
            )
        except Exception as exc:  # ORT raises its own untyped exception classes
            raise ConfigError(f"cannot load ONNX model {path}: {exc}") from None
        # ORT falls back to the next provider, silently, when one that it lists cannot
        # start (onnxruntime-gpu without its CUDA libraries): a GPU model on the CPU.
        if self._session.get_providers()[0] != providers[0]:
            raise ConfigError(
                f"ONNX model {path}: execution provider {providers[0]} did not start (ONNX "
                f"Runtime fell back to {', '.join(self._session.get_providers())}); for CUDA, "
                "check that the CUDA and cuDNN libraries onnxruntime-gpu needs are installed"
            )
        inputs = tuple(_tensor(a, "input", path) for a in self._session.get_inputs())
        outputs = tuple(_tensor(a, "output", path) for a in self._session.get_outputs())
        for t in inputs + outputs:
            if t.shape[0] != -1:
                # (an output that is not per sample at all, a summary of the whole batch,
                # cannot be fixed by relabelling: say so, rather than only point there)
                what = "output" if t in outputs else "input"
                raise ConfigError(
                    f"{path}: {what} {t.name!r} has a fixed dim 0 ({t.shape[0]}); carpool "
                    "needs a symbolic batch dim, one row per sample, and cannot serve an "
                    "output that is not per sample "
                    "(see docs/models.md: make the batch dim dynamic)"
                )
        self.path = Path(path)
        self._output_names = [t.name for t in outputs]
        self._info = with_rules(
            EngineInfo(engine_io(inputs, outputs, max_batch, sorted(set(preferred_batch)))),
            shape_rules or {},
            f"ONNX model {path}",
        )
        if shapes is not None:
            self._info = declare(self._info, shapes, f"ONNX model {path}")
        self.metadata: dict[str, str] = dict(self._session.get_modelmeta().custom_metadata_map)

    @property
    def info(self) -> EngineInfo:
        return self._info

    def run(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
        feeds = {name: np.ascontiguousarray(a) for name, a in inputs.items()}
        try:
            results = self._session.run(self._output_names, feeds)
        except Exception as exc:
            # ONNX Runtime's INVALID_ARGUMENT status: the inputs, not the model (a Gather
            # index out of range, say).
            if type(exc).__name__ == "InvalidArgument":
                raise BadInput(str(exc)) from exc
            raise
        return dict(zip(self._output_names, results, strict=True))

    def close(self) -> None:
        # InferenceSession has no close(); dropping the reference frees it.
        self.__dict__.pop("_session", None)
