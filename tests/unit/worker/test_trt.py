"""worker/engines/trt.py, the tensorrt adapter, on a recording stand-in for the tensorrt
module (put in ``sys.modules``): one logger for every Runtime, Builder and parser; shape
tensors marked as such; an output allocator that cannot allocate answers nullptr (0)
instead of raising into TensorRT. The names it uses are checked against the real releases
by tensorrt/test_api_surface.py."""

from __future__ import annotations

import sys
import types
from typing import Any, ClassVar

import pytest

from carpool.worker.cuda.base import CudaError
from carpool.worker.engines import trt as adapter


class Logger:
    WARNING = "WARNING"
    made: ClassVar[list[Logger]] = []

    def __init__(self, level: str) -> None:
        self.level = level
        Logger.made.append(self)


class DataType:
    def __init__(self, name: str) -> None:
        self.name = name


class Engine:
    """An ICudaEngine of three inputs: x (device), shape (shape-inference I/O) and k
    (placed on the host), and one output y."""

    num_io_tensors = 4
    names = ("x", "shape", "k", "y")

    def get_tensor_name(self, i: int) -> str:
        return self.names[i]

    def get_tensor_dtype(self, name: str) -> DataType:
        return DataType("INT32" if name in ("shape", "k") else "FLOAT")

    def get_tensor_mode(self, name: str) -> str:
        return "OUTPUT" if name == "y" else "INPUT"

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return (2,) if name in ("shape", "k") else (-1, 8)

    def is_shape_inference_io(self, name: str) -> bool:
        return name == "shape"

    def get_tensor_location(self, name: str) -> str:
        return "HOST" if name in ("shape", "k") else "DEVICE"


class Runtime:
    def __init__(self, logger: Logger) -> None:
        self.logger = logger

    def deserialize_cuda_engine(self, plan: bytes) -> Engine:
        return Engine()


class Parser:
    def __init__(self, network: Any, logger: Logger) -> None:
        self.logger = logger

    def parse_from_file(self, path: str) -> bool:
        return True


class Builder:
    def __init__(self, logger: Logger) -> None:
        self.logger = logger

    def create_network(self, flags: int) -> object:
        return object()


class IOutputAllocator:
    def __init__(self) -> None:
        pass


@pytest.fixture
def tensorrt(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = types.ModuleType("tensorrt")
    module.__version__ = "10.3.0"  # type: ignore[attr-defined]
    module.Logger = Logger  # type: ignore[attr-defined]
    module.Runtime = Runtime  # type: ignore[attr-defined]
    module.Builder = Builder  # type: ignore[attr-defined]
    module.OnnxParser = Parser  # type: ignore[attr-defined]
    module.IOutputAllocator = IOutputAllocator  # type: ignore[attr-defined]
    module.TensorIOMode = types.SimpleNamespace(INPUT="INPUT", OUTPUT="OUTPUT")  # type: ignore[attr-defined]
    module.TensorLocation = types.SimpleNamespace(DEVICE="DEVICE", HOST="HOST")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tensorrt", module)
    monkeypatch.setattr(adapter, "_trt_logger", None, raising=False)  # (none made yet)
    monkeypatch.setattr(Logger, "made", [])
    return module


def test_every_runtime_builder_and_parser_shares_one_logger(tensorrt) -> None:
    plans = [adapter.TrtPlan(b"plan", "model 'a'"), adapter.TrtPlan(b"plan", "model 'b'")]
    builder = adapter.TensorRTBuilder()
    builder.create_network(strongly_typed=False)
    assert builder.parse_onnx("model.onnx") == []
    (logger,) = Logger.made
    assert logger.level == Logger.WARNING
    assert [p._runtime.logger for p in plans] == [logger, logger]
    assert (builder._builder.logger, builder._parser.logger) == (logger, logger)


def test_shape_tensors_are_marked_on_the_host(tensorrt) -> None:
    tensors = adapter.TrtPlan(b"plan", "model 'm'").tensors()
    assert [(t.name, t.is_input, t.dtype, t.on_host) for t in tensors] == [
        ("x", True, "float32", False),
        ("shape", True, "int32", True),  # shape-inference I/O
        ("k", True, "int32", True),  # placed on the host
        ("y", False, "float32", False),
    ]


def test_an_allocation_that_fails_answers_nullptr_not_an_exception(tensorrt) -> None:
    class Full:
        def reallocate(self, name: str, nbytes: int) -> int:
            raise CudaError("cudaMalloc failed: cudaErrorMemoryAllocation")

    allocator = adapter._allocator_class(tensorrt)(Full())
    assert allocator.reallocate_output_async("pos", 0, 1 << 40, 256, 0) == 0
    assert allocator.reallocate_output("pos", 0, 1 << 40, 256) == 0
