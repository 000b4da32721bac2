"""trt.py: the TensorRT adapter — the only module that imports tensorrt.

A thin layer over the TensorRT Python API, one method per call carpool makes, and no
decisions of its own:

- running a plan: :class:`TrtPlan` (a Runtime's deserialized ``ICudaEngine``) and
  :class:`TrtContext` (an ``IExecutionContext``, with an ``IOutputAllocator`` for outputs
  whose shape depends on the data), the adapter protocols of
  :mod:`~carpool.worker.engines.trt_slots` on which :class:`TensorRTEngine`
  (:mod:`~carpool.worker.engines.trt_engine`, re-exported here) runs batches;
- building one: :class:`TensorRTBuilder` (Logger, Builder, create_network, OnnxParser,
  the builder config, optimization profiles, the timing cache, IProgressMonitor,
  build_serialized_network), driven by :func:`carpool.worker.tensorrt.build.build`;
- :func:`tensorrt_version`.

Everything else is logic tested against recording fakes of these classes. Only names
present in both TensorRT 10.3 (JetPack 6) and 11.x are used, except behind a ``hasattr``
guard; tests/unit/worker/tensorrt/test_api_surface.py checks that against the real
binding modules' member lists (tests/data/tensorrt/). tensorrt is imported inside the
methods, never at module load. One TensorRT logger serves every Runtime and Builder of the
process (TensorRT keeps a single logger pointer, which must outlive every object made
with it): :func:`shared_logger`, made on first use. Make no object here before the GPU probe
(:func:`carpool.worker.tensorrt.probe.probe`) has found a device: a Runtime or Builder
made without one can crash the interpreter.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from carpool.common.errors import ConfigError
from carpool.worker.engines.base import BadInput
from carpool.worker.engines.trt_engine import CONTEXTS, PendingBatch, TensorRTEngine
from carpool.worker.engines.trt_plan import Shape, TensorIO, numpy_dtype
from carpool.worker.engines.trt_slots import ContextAdapter, OutputStore

if TYPE_CHECKING:
    from carpool.worker.tensorrt.build import BuildListener

__all__ = [
    "CONTEXTS",
    "PendingBatch",
    "TensorRTBuilder",
    "TensorRTEngine",
    "TrtContext",
    "TrtPlan",
    "shared_logger",
    "tensorrt_version",
]

logger = logging.getLogger(__name__)

# The process's one TensorRT logger (tensorrt is imported on first use, not at load).
_trt_logger: Any = None
_trt_logger_lock = threading.Lock()


def shared_logger() -> Any:
    """The ``trt.Logger`` of every Runtime and Builder made here: made once, at WARNING,
    and kept for the life of the process (it must outlive every object made with it)."""
    global _trt_logger
    with _trt_logger_lock:
        if _trt_logger is None:
            import tensorrt as trt

            _trt_logger = trt.Logger(trt.Logger.WARNING)
        return _trt_logger


# -- running a plan -------------------------------------------------------------------


class TrtPlan:
    """:class:`~.trt_slots.PlanAdapter` on tensorrt: a plan deserialized by a Runtime.

    Create it only after a CUDA device answered (a Runtime made without one crashes the
    interpreter on first use) and on the thread that owns the CUDA context.

    Raises:
        ConfigError: tensorrt refused the plan (made by another TensorRT version or for
            another GPU: rebuild it).
    """

    def __init__(self, plan: bytes, what: str) -> None:
        import tensorrt as trt

        self._trt = trt
        self._runtime = trt.Runtime(shared_logger())
        self._engine = self._runtime.deserialize_cuda_engine(plan)
        if self._engine is None:
            raise ConfigError(
                f"{what}: TensorRT {trt.__version__} could not load the plan (built by "
                "another TensorRT version or for another GPU?); rebuild it with carpool "
                "build-engine"
            )
        self._what = what

    def tensors(self) -> list[TensorIO]:
        engine, trt = self._engine, self._trt
        out = []
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            dtype = numpy_dtype(engine.get_tensor_dtype(name).name, name)
            is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
            on_host = bool(engine.is_shape_inference_io(name)) or (
                engine.get_tensor_location(name) == trt.TensorLocation.HOST
            )
            shape = tuple(engine.get_tensor_shape(name))
            out.append(TensorIO(name, is_input, dtype, shape, on_host))
        return out

    def num_optimization_profiles(self) -> int:
        return int(self._engine.num_optimization_profiles)

    def get_tensor_profile_shape(self, name: str, index: int) -> tuple[Shape, Shape, Shape]:
        low, opt, high = self._engine.get_tensor_profile_shape(name, index)
        return tuple(low), tuple(opt), tuple(high)

    def create_execution_context(self) -> ContextAdapter:
        context = self._engine.create_execution_context()
        if context is None:
            raise ConfigError(f"{self._what}: TensorRT could not create an execution context")
        return TrtContext(self._trt, context)

    def close(self) -> None:
        self._engine = None  # TensorRT objects are freed with their last reference
        self._runtime = None


class TrtContext:
    """:class:`~.trt_slots.ContextAdapter` on a tensorrt ``IExecutionContext``."""

    def __init__(self, trt: Any, context: Any) -> None:
        self._trt = trt
        self._context = context
        self._allocators: list[Any] = []  # kept alive: TensorRT holds only a pointer

    def set_optimization_profile_async(self, index: int, stream: int) -> None:
        if not self._context.set_optimization_profile_async(index, stream):
            raise RuntimeError(f"TensorRT refused optimization profile {index}")

    def set_input_shape(self, name: str, shape: Shape) -> None:
        if not self._context.set_input_shape(name, shape):
            raise BadInput(f"TensorRT refused shape {list(shape)} for input {name!r}")

    def get_tensor_shape(self, name: str) -> Shape:
        return tuple(self._context.get_tensor_shape(name))

    def get_max_output_size(self, name: str) -> int:
        return int(self._context.get_max_output_size(name))

    def set_tensor_address(self, name: str, ptr: int) -> None:
        if not self._context.set_tensor_address(name, ptr):
            raise RuntimeError(f"TensorRT refused the address of tensor {name!r}")

    def set_output_allocator(self, name: str, store: OutputStore) -> None:
        allocator = _allocator_class(self._trt)(store)
        self._allocators.append(allocator)
        if not self._context.set_output_allocator(name, allocator):
            raise RuntimeError(f"TensorRT refused an output allocator for {name!r}")

    def execute_async_v3(self, stream: int) -> bool:
        return bool(self._context.execute_async_v3(stream))


def _allocator_class(trt: Any) -> Any:
    """An ``IOutputAllocator`` handing TensorRT an :class:`~.trt_slots.OutputStore`'s memory."""

    class StoreAllocator(trt.IOutputAllocator):  # type: ignore[misc]
        def __init__(self, store: OutputStore) -> None:
            super().__init__()
            self._store = store

        def reallocate_output_async(
            self, tensor_name: str, memory: int, size: int, alignment: int, stream: int
        ) -> int:
            return self._reallocate(tensor_name, size)

        def reallocate_output(
            self, tensor_name: str, memory: int, size: int, alignment: int
        ) -> int:
            return self._reallocate(tensor_name, size)

        def _reallocate(self, name: str, size: int) -> int:
            # An exception must not unwind through TensorRT: 0 (nullptr) tells it the
            # allocation failed, and its run then fails.
            try:
                return self._store.reallocate(name, size)
            except Exception:
                logger.exception("output %r: %d bytes could not be allocated", name, size)
                return 0

        def notify_shape(self, tensor_name: str, shape: Any) -> None:
            self._store.notify_shape(tensor_name, tuple(shape))

    return StoreAllocator


# -- building a plan ------------------------------------------------------------------


def tensorrt_version() -> str:
    """``tensorrt.__version__`` (importing the module creates no TensorRT object).

    Raises:
        ImportError: tensorrt is not installed.
    """
    import tensorrt as trt

    return str(trt.__version__)


class TensorRTBuilder:
    """One build: a network parsed from an ONNX file, a config, a plan.

    Raises:
        ImportError: from the constructor, when tensorrt is not installed.
    """

    def __init__(self) -> None:
        import tensorrt as trt

        self.version: str = str(trt.__version__)
        self._builder = trt.Builder(shared_logger())
        self._network: Any = None
        self._parser: Any = None
        self._config: Any = None
        self._timing: Any = None  # (TensorRT needs it alive until the build ends)
        self._monitor: Any = None

    def create_network(self, strongly_typed: bool) -> None:
        import tensorrt as trt

        flags = 0
        if strongly_typed:
            flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
        self._network = self._builder.create_network(flags)

    def parse_onnx(self, path: str) -> list[str]:
        """Parse the ONNX file at ``path`` into the network; the parser's errors."""
        import tensorrt as trt

        self._parser = trt.OnnxParser(self._network, shared_logger())
        if self._parser.parse_from_file(path):
            return []
        return [str(self._parser.get_error(i)) for i in range(self._parser.num_errors)]

    def create_config(self, workspace_bytes: int | None) -> None:
        import tensorrt as trt

        self._config = self._builder.create_builder_config()
        if workspace_bytes is not None:
            self._config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)

    def set_precision_flag(self, name: str) -> None:
        """Set ``BuilderFlag.<name>`` (FP16 or INT8: TensorRT 10 only).

        Raises:
            ValueError: this release has no such flag.
        """
        import tensorrt as trt

        flags = trt.BuilderFlag
        if name == "FP16" and hasattr(flags, "FP16"):
            self._config.set_flag(flags.FP16)
        elif name == "INT8" and hasattr(flags, "INT8"):
            self._config.set_flag(flags.INT8)
        else:
            raise ValueError(f"TensorRT {self.version} has no builder flag {name}")

    def add_profile(self, shapes: Sequence[tuple[str, Shape, Shape, Shape]]) -> int:
        """Add one optimization profile (name, min, opt, max per input); its index."""
        profile = self._builder.create_optimization_profile()
        for name, low, opt, high in shapes:
            profile.set_shape(name, low, opt, high)
        return int(self._config.add_optimization_profile(profile))

    def set_timing_cache(self, data: bytes) -> bool:
        """Use the serialized timing cache ``data`` (``b""``: a new one); False when
        TensorRT refuses it (made on another device or release)."""
        self._timing = self._config.create_timing_cache(data)
        return bool(self._config.set_timing_cache(self._timing, False))

    def timing_cache(self) -> bytes:
        """The timing cache as it is now (after a build: with that build's timings)."""
        return bytes(self._config.get_timing_cache().serialize())

    def set_listener(self, listener: BuildListener) -> None:
        """Report the build's phases to ``listener`` (IProgressMonitor)."""
        import tensorrt as trt

        class Monitor(trt.IProgressMonitor):  # type: ignore[misc]
            def __init__(self) -> None:
                trt.IProgressMonitor.__init__(self)

            def phase_start(
                self, phase_name: str, parent_phase: str | None, num_steps: int
            ) -> None:
                listener.phase_start(phase_name, parent_phase, num_steps)

            def step_complete(self, phase_name: str, step: int) -> bool:
                return listener.step_complete(phase_name, step)

            def phase_finish(self, phase_name: str) -> None:
                listener.phase_finish(phase_name)

        self._monitor = Monitor()
        self._config.progress_monitor = self._monitor

    def build(self) -> bytes | None:
        """The serialized plan, or None when TensorRT built none (its log says why)."""
        plan = self._builder.build_serialized_network(self._network, self._config)
        return None if plan is None else bytes(plan)
