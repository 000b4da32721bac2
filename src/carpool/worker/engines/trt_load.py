"""trt_load.py: a model's TensorRT engine, its plan found through the engine cache, or its
ONNX Runtime engine when TensorRT cannot serve it here.

In order, before any TensorRT object is made: is tensorrt installed; does a GPU answer
(:func:`~carpool.worker.tensorrt.probe.probe`, in a child process). Then the plan's cache
key (:mod:`carpool.worker.tensorrt.cache`) from this machine (``tensorrt.__version__``,
the GPU's name and compute capability, the L4T release on a Jetson) and the model (its
ONNX file's hash, the profiles and precision of its ``[tensorrt]`` table): a plan filed
under that key loads; a missing, stale or foreign one is built here where the model's
``build`` is true, else refused naming the ``carpool build-engine`` command to run. The
CUDA layer is opened on this thread (the inference thread, which owns it) and the plan
loaded. Whatever stops TensorRT is said in one log line, and the same ONNX model is
served with ONNX Runtime, unless the model's ``backends`` forbid it.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from carpool.common.errors import ConfigError
from carpool.worker.cuda import open_cuda
from carpool.worker.cuda.base import CudaError, CudaUnavailable
from carpool.worker.engines.base import Engine
from carpool.worker.engines.trt import TensorRTBuilder, TensorRTEngine, TrtPlan, tensorrt_version
from carpool.worker.shapes import ModelShapes
from carpool.worker.tensorrt.build import Builder, BuildError, BuildRequest, ensure, prepare
from carpool.worker.tensorrt.probe import GpuProbe, probe
from carpool.worker.tensorrt.progress import PlainListener
from carpool.worker.tensorrt.versions import TrtVersion

logger = logging.getLogger(__name__)

GET_TENSORRT = "TensorRT is not installed (docs/gpu.md says how to get it)"


def load_tensorrt(plan: Path, what: str, shapes: ModelShapes | None = None) -> Engine:
    """The TensorRT engine of ``plan`` on CUDA device 0, owned by this thread.

    Raises:
        ConfigError: TensorRT refused the plan; CudaUnavailable: no CUDA binding opens.
    """
    cuda = open_cuda(0)
    try:
        return TensorRTEngine(TrtPlan(plan.read_bytes(), what), cuda, what=what, shapes=shapes)
    except BaseException:
        cuda.close()
        raise


def _installed() -> bool:
    return importlib.util.find_spec("tensorrt") is not None


@dataclass(frozen=True, slots=True)
class TensorRT:
    """What serving with TensorRT asks of the machine (a seam: the tests give fakes)."""

    installed: Callable[[], bool] = _installed
    probe: Callable[[], GpuProbe] = probe
    version: Callable[[], str] = tensorrt_version  # tensorrt.__version__ (imports, makes nothing)
    new_builder: Callable[[], Builder] = TensorRTBuilder
    load: Callable[[Path, str, ModelShapes | None], Engine] = load_tensorrt


class Unavailable(Exception):
    """TensorRT cannot serve the model here (the message says why)."""


def find_plan(
    request: Callable[[], BuildRequest], may_build: bool, trt: TensorRT, what: str
) -> Path:
    """The model's plan from the engine cache, else built (``may_build``); nothing of
    TensorRT is made before the probe has found a GPU.

    Raises:
        Unavailable: why there is no plan to load (no tensorrt, no GPU, a profile set or
            precision the model cannot have, a plan that is not there and may not be
            built here, a failed build).
    """
    if not trt.installed():
        raise Unavailable(GET_TENSORRT)
    found = trt.probe()
    if found.device is None:
        raise Unavailable(found.reason)
    try:
        version = TrtVersion.parse(trt.version())
        asked = request()
        prepared = prepare(asked, version, found.device)
        listener = PlainListener(sys.stderr)  # (a build's phases, on the worker's log)
        outcome = ensure(asked, prepared, trt.new_builder, listener, may_build=may_build)
    except ImportError as exc:
        raise Unavailable(f"tensorrt does not import: {exc}") from None
    except (ConfigError, BuildError, OSError) as exc:
        raise Unavailable(str(exc).removeprefix(f"{what}: ")) from None
    if outcome.built:
        logger.info("%s: built %s (%s)", what, outcome.plan, "; ".join(outcome.notes))
    return outcome.plan


def tensorrt_or_onnxruntime(
    request: Callable[[], BuildRequest],
    what: str,
    onnxruntime: Callable[[], Engine],
    *,
    may_build: bool = False,
    may_fall_back: bool = True,
    shapes: ModelShapes | None = None,
    trt: TensorRT | None = None,
) -> Engine:
    """The TensorRT engine of the model ``request()`` describes, else (logged, one line)
    ``onnxruntime()``.

    Raises:
        ConfigError: TensorRT cannot serve it and ``may_fall_back`` is false.
    """
    trt = TensorRT() if trt is None else trt
    try:
        plan = find_plan(request, may_build, trt, what)
        return trt.load(plan, what, shapes)
    except Unavailable as exc:
        reason = str(exc)
    except (ConfigError, CudaUnavailable, CudaError, ImportError, OSError, RuntimeError) as exc:
        reason = f"the plan did not load: {exc}"
    if not may_fall_back:
        raise ConfigError(f"{what} cannot be served with TensorRT here: {reason}")
    logger.warning("%s: serving with ONNX Runtime, not TensorRT: %s", what, reason)
    return onnxruntime()
