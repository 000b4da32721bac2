"""factory.py: the engines and the WorkerServer that a worker's config describes.

:mod:`carpool.worker.config` holds the settings as data; this module builds from them:
:func:`engine_factory` gives a model's engine factory (called on the inference thread),
:func:`worker_server` a WorkerServer with its engines' factories.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

from carpool.common.curve import client_keys
from carpool.common.errors import ConfigError
from carpool.worker.config import ModelConfig, WorkerConfig, default_name
from carpool.worker.engines.base import Engine
from carpool.worker.engines.ort import OnnxRuntimeEngine
from carpool.worker.engines.synthetic import SyntheticEngine
from carpool.worker.engines.trt_load import tensorrt_or_onnxruntime
from carpool.worker.models import locate, locate_source
from carpool.worker.repository import builtin
from carpool.worker.server import EngineFactory, WorkerServer
from carpool.worker.tensorrt.build import request_for


def engine_factory(model: ModelConfig) -> EngineFactory:
    """A function that builds ``model``'s engine (called on the inference thread).

    Raises:
        ConfigError: ``backends`` does not name the engine it would be served with.
    """
    if model.backends and model.engine not in model.backends:
        raise ConfigError(
            f"model {model.name!r} may be served with {', '.join(model.backends)} only "
            f"(its backends), not {model.engine}"
        )
    build: Callable[[ModelConfig], Engine] = _onnxruntime
    if model.engine == "synthetic":
        build = _synthetic
    elif model.engine == "tensorrt":
        build = _tensorrt
    return functools.partial(build, model)


def worker_server(
    config: WorkerConfig,
    *,
    embedded: bool = False,
    starting: Callable[[float], None] | None = None,
) -> WorkerServer:
    """A WorkerServer with ``config``'s settings (``embedded``: inside a broker's process,
    see ``BrokerServer(embedded=)``; ``config.broker`` is not used then; ``starting``: told
    the seconds waited while its engines start, see :class:`WorkerServer`).

    Raises:
        ConfigError: a model whose backends leave out its engine, or CURVE key files that
            do not load.
    """
    return WorkerServer(
        config.broker,
        {m.name: engine_factory(m) for m in config.models},
        name=config.name or default_name(),
        slots=config.slots,
        heartbeat_s=config.heartbeat_s,
        liveness=config.liveness,
        shm_output_bytes=config.shm_output_mib << 20,
        shm_output_mode=config.shm_output_mode,
        shm_output_group=config.shm_output_group or None,
        embedded=embedded,
        metrics="" if embedded else config.metrics,
        start_timeout_s=config.start_timeout_s,
        starting=starting,
        curve=None
        if embedded
        else client_keys(config.curve_broker_key, config.curve_key, "curve_key (--curve-key)"),
    )


def _synthetic(model: ModelConfig) -> Engine:
    return SyntheticEngine(
        fixed_cost_s=model.fixed_cost_s,
        per_sample_s=model.per_sample_s,
        item_shape=model.item_shape,
        dtype=model.dtype,
        max_batch=model.max_batch,
        preferred_batch=model.preferred_batch,
        shapes=model.shapes(),
    )


def _tensorrt(model: ModelConfig) -> Engine:
    full, onnx = _onnx(model)
    folder = Path(full.folder) if full.folder else Path(onnx).parent
    return tensorrt_or_onnxruntime(
        lambda: request_for(full, folder, folder.parent),
        f"model {model.name!r}",
        functools.partial(_onnxruntime, model),
        may_build=full.tensorrt.build,
        may_fall_back=not model.backends or "onnxruntime" in model.backends,
        shapes=full.shapes(),
    )


def _onnxruntime(model: ModelConfig) -> Engine:
    full, path = _onnx(model)
    return OnnxRuntimeEngine(
        path,
        max_batch=model.max_batch,
        intra_op_threads=model.intra_op_threads,
        preferred_batch=model.preferred_batch,
        providers=model.providers,
        shapes=full.shapes(),
    )


def _onnx(model: ModelConfig) -> tuple[ModelConfig, str]:
    """``model`` over its built-in base (if any), and the path of its ONNX file."""
    full = model
    if not model.path and model.source is None:
        base = builtin().models.get(model.name)
        if base is None:
            locate(model.name)  # raises: unknown model, and what to do instead
        else:
            full = model.over(base.config)
    if full.source is not None:
        return full, str(locate_source(full.source, f"model {model.name!r}"))
    return full, full.path
