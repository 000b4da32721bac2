"""trt_load.py: a model's TensorRT engine, or its ONNX Runtime engine when TensorRT
cannot serve it here.

Before any TensorRT object is made: is tensorrt installed, does a GPU answer
(:func:`~carpool.worker.tensorrt.probe.probe`, in a child process), is the plan there. Then
the CUDA layer
is opened on this thread (the inference thread, which owns it) and the plan loaded. A
worker without TensorRT, without a GPU, or with a plan that fails to load (missing, built
by another TensorRT or for another GPU) says so in one log line and serves the same ONNX
model with ONNX Runtime, unless the model's ``backends`` forbid it.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from pathlib import Path

from carpool.common.errors import ConfigError
from carpool.worker.cuda import open_cuda
from carpool.worker.cuda.base import CudaError, CudaUnavailable
from carpool.worker.engines.base import Engine
from carpool.worker.shapes import ModelShapes
from carpool.worker.tensorrt.probe import GpuProbe, probe

logger = logging.getLogger(__name__)


def unavailable(plan: Path, probe: Callable[[], GpuProbe] = probe) -> str | None:
    """Why TensorRT cannot serve ``plan`` here, or None when it may try; nothing of
    TensorRT is imported or made."""
    if importlib.util.find_spec("tensorrt") is None:
        return "TensorRT is not installed (docs/gpu.md says how to get it)"
    found = probe()
    if not found.ok:
        return found.reason
    if not plan.is_file():
        return f"no TensorRT plan at {plan} (build one: carpool build-engine)"
    return None


def load_tensorrt(plan: Path, what: str, shapes: ModelShapes | None = None) -> Engine:
    """The TensorRT engine of ``plan`` on CUDA device 0, owned by this thread.

    Raises:
        ConfigError: TensorRT refused the plan; CudaUnavailable: no CUDA binding opens.
    """
    from carpool.worker.engines.trt import TensorRTEngine, TrtPlan

    cuda = open_cuda(0)
    try:
        return TensorRTEngine(TrtPlan(plan.read_bytes(), what), cuda, what=what, shapes=shapes)
    except BaseException:
        cuda.close()
        raise


def tensorrt_or_onnxruntime(
    plan: Path,
    what: str,
    onnxruntime: Callable[[], Engine],
    *,
    may_fall_back: bool = True,
    shapes: ModelShapes | None = None,
    probe: Callable[[], GpuProbe] = probe,
) -> Engine:
    """The TensorRT engine of ``plan``, else (logged, one line) ``onnxruntime()``.

    Raises:
        ConfigError: TensorRT cannot serve it and ``may_fall_back`` is false.
    """
    reason = unavailable(plan, probe)
    if reason is None:
        try:
            return load_tensorrt(plan, what, shapes)
        except (ConfigError, CudaUnavailable, CudaError, ImportError, OSError, RuntimeError) as exc:
            reason = f"the plan did not load: {exc}"
    if not may_fall_back:
        raise ConfigError(f"{what} cannot be served with TensorRT here: {reason}")
    logger.warning("%s: serving with ONNX Runtime, not TensorRT: %s", what, reason)
    return onnxruntime()
