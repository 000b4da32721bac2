"""trt_builder.py: the TensorRT builder adapter — the only module that imports tensorrt to
build a plan.

A thin layer over the TensorRT Python API, one method per call it makes (Logger, Builder,
create_network, OnnxParser, create_builder_config, set_memory_pool_limit, set_flag,
create_optimization_profile / set_shape / add_optimization_profile, the timing cache,
IProgressMonitor, build_serialized_network). Every decision (which flags, which profiles,
which timing cache, when to build at all) is made by the pure modules of
:mod:`carpool.worker.tensorrt`, whose build orchestration (:mod:`.build`) is tested
against a recording fake of this class. Only names present in both TensorRT 10.3 and
11.x are used, except where a ``hasattr`` guard says otherwise; a test checks that
against the real binding modules' member lists (tests/data/tensorrt/).

Never create it before :func:`carpool.worker.tensorrt.probe.probe` has found a GPU: a
Builder made without one can crash the interpreter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

__all__ = ["BuildListener", "TensorRTBuilder", "tensorrt_version"]

Shape = tuple[int, ...]


class BuildListener(Protocol):
    """What hears TensorRT's build phases (IProgressMonitor's calls, same arguments)."""

    def phase_start(self, phase: str, parent: str | None, steps: int) -> None: ...

    def step_complete(self, phase: str, step: int) -> bool: ...

    def phase_finish(self, phase: str) -> None: ...


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
        # The logger must outlive every object made with it: it is kept here.
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._builder = trt.Builder(self._logger)
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

        self._parser = trt.OnnxParser(self._network, self._logger)
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
