"""config.py: the worker's settings as data — WorkerConfig, ModelConfig and their tables
— parsed and checked, with their defaults. It builds nothing: the engines and the server
they describe are built by :mod:`carpool.worker.factory`."""

from __future__ import annotations

import dataclasses
import os
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from carpool.common.config import MAX_BATCH_CEILING, check, out_of_range
from carpool.common.errors import ConfigError
from carpool.common.listen import listen_problems
from carpool.common.protocol import DTYPES, MAX_MODELS, MAX_NAME_CHARS, MAX_RANK
from carpool.worker.shapes import InputConfig, ModelShapes, OutputConfig
from carpool.worker.tensorrt.precision import PRECISIONS
from carpool.worker.tensorrt.profile_text import parse_batch, parse_profile

ENGINES = ("onnxruntime", "tensorrt", "synthetic")


@dataclass(frozen=True, slots=True)
class SourceConfig:
    """``[source]``: a model's ONNX file inside an installed wheel (found by
    :func:`carpool.worker.models.locate_source`)."""

    distribution: str  # the PyPI distribution that ships the file
    version: str  # the version pinned (installed with pip install --no-deps D==V)
    file: str  # the file's name inside the wheel
    sha256: str = ""  # of the file; "" leaves it unchecked

    def problems(self) -> list[str]:
        """What is wrong with this table by itself, each as ``key rule``."""
        out = [
            f"{k} must not be empty"
            for k in ("distribution", "version", "file")
            if not getattr(self, k)
        ]
        if self.sha256 and not re.fullmatch(r"[0-9a-f]{64}", self.sha256):
            out.append("sha256 must be 64 lowercase hex digits")
        return out

    def hint(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"


@dataclass(frozen=True, slots=True)
class TensorRTConfig:
    """A model's ``[tensorrt]`` table: its plan's build settings, which are also part of
    the key a worker finds the plan under in the engine cache (docs/gpu.md). Each but
    ``build`` is the default of the ``carpool build-engine`` flag of that name."""

    precision: str = "fp32"  # fp32 | fp16 | int8
    # Optimization profiles, each as --profile gives one ("x=1x3x48x160:8x3x48x320:
    # 8x3x48x320", inputs separated by ","); empty: derived from buckets and shape rules.
    profiles: tuple[str, ...] = ()
    batches: tuple[str, ...] = ()  # batch ranges "MIN:OPT:MAX" (--batch); empty: 1..max_batch
    max_profiles: int = 8  # refuse a larger profile set
    max_ratio: float = 16.0  # refuse a dim whose max/min exceeds this
    workspace_mib: int = 0  # build scratch memory limit; 0: TensorRT's default
    # Build a missing or stale plan on this worker, before READY (minutes: the worker's
    # start_timeout_s must allow for them); false: refuse, naming the build-engine
    # command.
    build: bool = False

    def over(self, base: TensorRTConfig) -> TensorRTConfig:
        """This table laid over ``base``'s key by key (the keys this one sets win)."""
        default = TensorRTConfig()
        names = [f.name for f in dataclasses.fields(self)]
        mine = {n: getattr(self, n) for n in names if getattr(self, n) != getattr(default, n)}
        return dataclasses.replace(base, **mine)

    def problems(self) -> list[str]:
        out = []
        if self.precision not in PRECISIONS:
            out.append(f"tensorrt.precision must be one of {', '.join(PRECISIONS)}")
        if self.max_profiles < 1 or self.max_ratio < 1 or self.workspace_mib < 0:
            out.append("tensorrt: max_profiles and max_ratio must be >= 1, workspace_mib >= 0")
        if not (self.profiles or self.batches):
            return out
        texts = [(t, parse_profile) for t in self.profiles] + [
            (t, parse_batch) for t in self.batches
        ]
        out += [f"tensorrt: {why}" for text, parse in texts if (why := _refusal(parse, text))]
        return out


def _refusal(parse: Callable[[str], object], text: str) -> str | None:
    try:
        parse(text)
    except ConfigError as exc:
        return str(exc)
    return None


#: What a model's ``backends`` may name: the engines that may serve it.
BACKENDS = ("onnxruntime", "tensorrt", "synthetic")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """One model a worker serves: a ``[[models]]`` table of worker.toml, or a model
    repository's ``model.toml`` (one schema; every key in docs/models.md)."""

    name: str = "orientation"  # a built-in model's name, or any name with `path`/`source`
    engine: str = "onnxruntime"  # onnxruntime | tensorrt | synthetic
    path: str = ""  # an ONNX file; empty (and no source): the built-in model `name`
    source: SourceConfig | None = None  # or a file inside an installed wheel
    # The model's folder: its TensorRT plans are cached in FOLDER/plans/. A repository
    # sets it; empty: the ONNX file's folder.
    folder: str = ""
    # tensorrt engine only: how its plan is built and found. Without TensorRT, a GPU or a
    # plan that loads, ONNX Runtime serves the ONNX file (unless backends leave it out).
    tensorrt: TensorRTConfig = TensorRTConfig()
    description: str = ""
    # The engines that may serve it ("onnxruntime", "tensorrt", "synthetic"); a worker
    # refuses to serve it with another. Empty: any.
    backends: tuple[str, ...] = ()
    # The largest batch this worker takes of the model. By default what the engine takes:
    # any batch for a symbolic batch dim, announced as the broker's ceiling, so that the
    # broker's max_batch is the one that binds (STATS: max_batch_bound_by).
    max_batch: int = MAX_BATCH_CEILING
    preferred_batch: tuple[int, ...] = ()
    intra_op_threads: int = 1
    # ONNX Runtime execution providers, in order of preference: e.g. ["CUDAExecutionProvider",
    # "CPUExecutionProvider"] with onnxruntime-gpu installed (checked when the model loads).
    providers: tuple[str, ...] = ("CPUExecutionProvider",)
    # synthetic engine only: batch cost = fixed_cost_s + per_sample_s * B
    fixed_cost_s: float = 0.0
    per_sample_s: float = 0.0
    item_shape: tuple[int, ...] = (16,)
    dtype: str = "float32"
    # Per input ([inputs.NAME]): limits on its dynamic dims (min_shape, max_shape,
    # multiple_of; protocol §8.1), which the broker enforces, and its pad rule
    # ([inputs.NAME.pad]). A built-in model's own (ppocr-det: H and W padded to
    # multiples of 32) apply unless replaced, input by input.
    inputs: dict[str, InputConfig] = field(default_factory=dict)
    # Per output ([outputs.NAME]): the axes cropped back to a request's extent (crop).
    outputs: dict[str, OutputConfig] = field(default_factory=dict)
    # Full input shapes (dim 0 included) the warm-up runs on, by input name: run k takes
    # entry k of every input. Empty: the warm-up guesses one shape from the shape rules.
    warmup: dict[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        problems = []
        if not 1 <= len(self.name) <= MAX_NAME_CHARS:
            problems.append(f"name must have 1..{MAX_NAME_CHARS} characters")
        if self.engine not in ENGINES:
            problems.append(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        unknown = [b for b in self.backends if b not in BACKENDS]
        if unknown or len(set(self.backends)) != len(self.backends):
            problems.append(f"backends must name each of {', '.join(BACKENDS)} at most once")
        if self.path and self.source is not None:
            problems.append("path and source both name the ONNX file: give one")
        if self.source is not None:
            problems += [f"source.{p}" for p in self.source.problems()]
        if not 1 <= self.max_batch <= MAX_BATCH_CEILING:
            problems.append(f"max_batch must be in 1..{MAX_BATCH_CEILING}")
        if any(not 1 <= p <= self.max_batch for p in self.preferred_batch):
            problems.append("preferred_batch sizes must lie in 1..max_batch")
        if self.fixed_cost_s < 0 or self.per_sample_s < 0:
            problems.append("fixed_cost_s and per_sample_s must be >= 0")
        if self.intra_op_threads < 1:
            problems.append("intra_op_threads must be >= 1")
        if not self.providers or not all(self.providers):
            problems.append("providers must name at least one execution provider")
        problems += self.tensorrt.problems()
        if self.engine == "synthetic":  # (an ONNX model's shapes come from its file)
            rank = len(self.item_shape)
            if not 1 <= rank < MAX_RANK or any(d < 1 and d != -1 for d in self.item_shape):
                problems.append(
                    f"item_shape must have 1..{MAX_RANK - 1} dims, each at least 1 or -1 "
                    f"(dynamic); the batch dim makes {MAX_RANK}"
                )
            if self.dtype not in DTYPES:
                problems.append(f"dtype must be one of {', '.join(sorted(DTYPES))}")
        check(problems, f"model {self.name!r}")

    @classmethod
    def synthetic(
        cls, name: str, fixed_ms: float, per_sample_ms: float, max_batch: int
    ) -> ModelConfig:
        """A synthetic model whose batch costs ``fixed_ms + per_sample_ms * B``."""
        return cls(
            name=name,
            engine="synthetic",
            max_batch=max_batch,
            fixed_cost_s=fixed_ms / 1000,
            per_sample_s=per_sample_ms / 1000,
        )

    def shapes(self) -> ModelShapes:
        """Its shape declarations, for the engine (:mod:`carpool.worker.shapes`)."""
        return ModelShapes(self.inputs, self.outputs, self.warmup)

    def over(self, base: ModelConfig) -> ModelConfig:
        """This model on ``base``'s file (a built-in model of the same name): ``base``'s
        description, backends, warm-up and folder where this has none, its inputs and
        outputs where this does not declare them, its [tensorrt] keys where this does not
        set them."""
        return dataclasses.replace(
            self,
            path=base.path,
            source=base.source,
            folder=self.folder or base.folder,
            tensorrt=self.tensorrt.over(base.tensorrt),
            description=self.description or base.description,
            backends=self.backends or base.backends,
            inputs={**base.inputs, **self.inputs},
            outputs={**base.outputs, **self.outputs},
            warmup=self.warmup or base.warmup,
        )


def model_from_arg(text: str, repository: Mapping[str, ModelConfig] | None = None) -> ModelConfig:
    """The model of one ``carpool worker --model`` value.

    ``text`` is the name of a model in ``repository`` (``--repository``'s models), a
    built-in model's name (``orientation``), the path of an ONNX file (served under the
    file's name without its suffix: ``/models/my.onnx`` is model ``my``), or
    ``NAME=PATH``. A value with a ``/`` or ending in ``.onnx`` is a path.

    Raises:
        ConfigError: a path that is not a file, or a name ModelConfig refuses.
    """
    if repository is not None and text in repository:
        return repository[text]
    name, sep, path = text.partition("=")
    if not sep or "/" in name:  # (a path may hold a "=" of its own)
        name, path = "", text
    if not name and "/" not in path and not path.lower().endswith(".onnx"):
        return ModelConfig(name=path)  # a catalogue name (checked when the engine loads)
    if not Path(path).is_file():
        raise ConfigError(f"--model {text}: no ONNX file {path}")
    return ModelConfig(name=name or Path(path).stem, path=path)


def default_name() -> str:
    """A worker's name when none is given: its host and process id."""
    return f"{socket.gethostname()}-{os.getpid()}"[:MAX_NAME_CHARS]


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    broker: str = "tcp://127.0.0.1:5556"  # the broker's backend endpoint
    # In logs and STATS; "" (the default): HOST-PID, so that workers tell apart.
    name: str = ""
    slots: int = 2  # batches outstanding here at most (credits)
    heartbeat_s: float = 1.0
    liveness: int = 3  # silent heartbeat intervals before reconnecting
    models: tuple[ModelConfig, ...] = field(default_factory=lambda: (ModelConfig(),))
    # A model repository (docs/models.md): without [[models]], the worker serves every
    # model in it; a [[models]] table that names one of its models (and no path or
    # source) is that model, with the table's keys over its model.toml's. Read by the
    # entry point (carpool.worker.repository.worker_models), not here.
    repository: str = ""
    # Shared-memory outputs (protocol §5.5) for clients on this host that ask for them:
    # the ring's size (0: never, outputs always go in frames) and its file permissions
    # (0o600: clients of this user only; 0o640: also the ring's group).
    shm_output_mib: int = 64
    shm_output_mode: int = 0o600
    shm_output_group: str = ""  # the ring's group ("": the worker's own)
    # CURVE to a broker that has it on (docs/security.md): the broker's public key (its
    # .key file, or Z85 text) and this worker's .key_secret file (mode 0600). Both or none.
    curve_broker_key: str = ""
    curve_key: str = ""
    # HOST:PORT of the Prometheus endpoint (/metrics, /healthz, /readyz); a bare PORT
    # listens on 127.0.0.1; "": none (docs/operations.md).
    metrics: str = ""
    # Under systemd (WatchdogSec=): a batch running longer than this stops the watchdog
    # pings, and systemd restarts the worker (a hung engine). 0: a batch never counts as
    # hung. Above any batch's honest time, a TensorRT first run included.
    hung_batch_s: float = 120.0
    # How long building, warming up and checking the engines may take before the worker
    # gives up with an error; under systemd it extends the unit's start timeout
    # (TimeoutStartSec=) that long. A TensorRT plan built at start can need more.
    start_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        problems = out_of_range(
            self, {"slots": (1, 1024), "heartbeat_s": (0.01, 600), "liveness": (1, 100)}
        )
        if len(self.name) > MAX_NAME_CHARS:
            problems.append(f"name must have at most {MAX_NAME_CHARS} characters")
        if not 1 <= len(self.models) <= MAX_MODELS:
            problems.append(f"1..{MAX_MODELS} [[models]] entries are needed")
        problems += out_of_range(
            self,
            {
                "shm_output_mib": (0, 1 << 20),
                "hung_batch_s": (0, 86_400),
                "start_timeout_s": (1, 86_400),
            },
        )
        if not 0 <= self.shm_output_mode <= 0o777 or self.shm_output_mode & 0o022:
            problems.append(
                "shm_output_mode must be a file mode such as 0o600 or 0o640: clients may "
                "read the ring, never write it (a writer could truncate it under the worker)"
            )
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            problems.append("model names must be unique")
        if bool(self.curve_broker_key) != bool(self.curve_key):
            problems.append("curve_broker_key and curve_key go together (CURVE needs both)")
        check(problems + listen_problems(self.metrics), "worker")
