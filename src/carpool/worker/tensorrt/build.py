"""build.py: a model's plan — found in the engine cache, or built through the adapter.

:func:`prepare` (pure) checks the profile set's size, turns the precision into flags for
this TensorRT release and computes the plan's cache key; :func:`ensure` looks the key up
and, on a miss, builds (or refuses, where the caller may not build); :func:`build` drives
a :class:`Builder` — :class:`~carpool.worker.engines.trt.TensorRTBuilder`, or a
recording fake in the tests — through one build: network, ONNX parse, config, precision
flags, one optimization profile per profile, the timing cache loaded before and saved
after, the progress listener, the plan stored with its sidecar.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from carpool.common.errors import CarpoolError, ConfigError
from carpool.worker import modelcheck
from carpool.worker.models import sha256_of
from carpool.worker.tensorrt import cache
from carpool.worker.tensorrt.cache import Device, Hit, PlanKey
from carpool.worker.tensorrt.precision import OnnxPrecision, PrecisionPlan, inspect_onnx
from carpool.worker.tensorrt.precision import plan as precision_plan
from carpool.worker.tensorrt.profile_text import parse_batch
from carpool.worker.tensorrt.profiles import Limits, Profile, check_limits, from_flags, from_model
from carpool.worker.tensorrt.versions import TrtVersion

if TYPE_CHECKING:
    from carpool.worker.config import ModelConfig, TensorRTConfig

__all__ = [
    "BuildError",
    "BuildListener",
    "BuildRequest",
    "Builder",
    "Outcome",
    "build",
    "ensure",
    "prepare",
    "request_for",
]

Shape = tuple[int, ...]


class BuildError(CarpoolError):
    """A plan could not be had: TensorRT failed, or the worker may not build one."""


class BuildListener(Protocol):
    """What hears TensorRT's build phases (IProgressMonitor's calls, same arguments)."""

    def phase_start(self, phase: str, parent: str | None, steps: int) -> None: ...

    def step_complete(self, phase: str, step: int) -> bool: ...

    def phase_finish(self, phase: str) -> None: ...


class Builder(Protocol):
    """The adapter's methods a build uses (TensorRTBuilder has each)."""

    version: str

    def create_network(self, strongly_typed: bool) -> None: ...

    def parse_onnx(self, path: str) -> list[str]: ...

    def create_config(self, workspace_bytes: int | None) -> None: ...

    def set_precision_flag(self, name: str) -> None: ...

    def add_profile(self, shapes: Sequence[tuple[str, Shape, Shape, Shape]]) -> int:
        """Add one optimization profile; its index (raises RuntimeError where TensorRT
        refuses the shapes, as ``IOptimizationProfile.set_shape`` does)."""
        ...

    def set_timing_cache(self, data: bytes) -> bool: ...

    def timing_cache(self) -> bytes: ...

    def set_listener(self, listener: BuildListener) -> None: ...

    def build(self) -> bytes | None: ...


@dataclass(frozen=True, slots=True)
class BuildRequest:
    """One model's plan, as asked."""

    model: str
    onnx: Path  # its ONNX file
    folder: Path  # its folder in the repository (plans/ goes there)
    repository: Path  # the repository (its .timing/ holds the timing caches)
    profiles: tuple[Profile, ...]
    onnx_precision: OnnxPrecision
    precision: str = "fp32"
    workspace_bytes: int | None = None  # build scratch memory limit; None: TensorRT's default
    limits: Limits = field(default_factory=Limits)


@dataclass(frozen=True, slots=True)
class Prepared:
    key: PlanKey
    precision: PrecisionPlan
    version: TrtVersion


@dataclass(frozen=True, slots=True)
class Outcome:
    plan: Path
    built: bool  # False: found in the cache
    notes: tuple[str, ...] = ()  # lines for the user (precision, timing cache, why built)


def request_for(
    config: ModelConfig, folder: Path, repository: Path, settings: TensorRTConfig | None = None
) -> BuildRequest:
    """The plan of model ``config`` (in ``folder``, of ``repository``), as ``settings`` (its
    ``[tensorrt]`` table unless given) asks: its profiles (``settings.profiles``, else
    derived from its buckets and shape rules over ``settings.batches``), precision and
    limits. Reads the ONNX file's inputs and precision; the same for build-engine and for
    a worker, so that both file a plan under one key.

    Raises:
        ConfigError: the file cannot be read, or the profiles cannot be had from it.
    """
    settings = config.tensorrt if settings is None else settings
    io, problems = modelcheck.read(config)
    if problems or not io.inputs:
        listed = "; ".join(f"{key}: {rule}" for key, rule in problems) or "no inputs read"
        raise ConfigError(f"model {config.name!r}: {listed}")
    if settings.profiles:
        found = from_flags(config.name, io.inputs, settings.profiles)
    else:
        batches = [parse_batch(b) for b in settings.batches]
        found = from_model(config, io.inputs, batches)
    return BuildRequest(
        model=config.name,
        onnx=Path(io.file),
        folder=folder,
        repository=repository,
        profiles=found,
        onnx_precision=inspect_onnx(io.file),
        precision=settings.precision,
        workspace_bytes=settings.workspace_mib << 20 or None,
        limits=Limits(settings.max_profiles, settings.max_ratio),
    )


def prepare(request: BuildRequest, version: TrtVersion, device: Device) -> Prepared:
    """The key and precision plan of ``request`` on this release and device.

    Raises:
        ConfigError: too many profiles, too wide a dim, or a precision this file cannot
            have on this release (each message says which and why).
    """
    check_limits(request.model, request.profiles, request.limits)
    flags = precision_plan(request.precision, version, request.onnx_precision, request.model)
    key = PlanKey(
        onnx_sha256=sha256_of(request.onnx),
        trt_version=version.text,
        device=device,
        profiles=tuple([r.to_key() for r in p.inputs] for p in request.profiles),
        precision=flags.to_key(),
    )
    return Prepared(key, flags, version)


def ensure(
    request: BuildRequest,
    prepared: Prepared,
    new_builder: Callable[[], Builder],
    listener: BuildListener,
    *,
    may_build: bool = True,
    force: bool = False,
) -> Outcome:
    """``request``'s plan from the cache, else built (``force``: built in any case).

    Raises:
        BuildError: no plan in the cache and ``may_build`` is False (the message says
            why the cached ones do not fit and how to build one), or the build failed.
        ConfigError: TensorRT refused an optimization profile.
    """
    found = cache.lookup(request.folder, prepared.key)
    if isinstance(found, Hit) and not force:
        return Outcome(found.plan, built=False, notes=(prepared.precision.note,))
    why = "rebuilt as asked (--force)" if isinstance(found, Hit) else found.reason
    if not may_build:
        raise BuildError(
            f"model {request.model!r}: {why}; this worker does not build plans: run "
            f"`carpool build-engine --repository {request.repository} {request.model}` "
            "on this machine"
        )
    return build(new_builder(), request, prepared, listener, notes=(why,))


def build(
    builder: Builder,
    request: BuildRequest,
    prepared: Prepared,
    listener: BuildListener,
    notes: Sequence[str] = (),
) -> Outcome:
    """One build through ``builder``; the plan stored in the cache.

    Raises:
        BuildError: TensorRT could not parse the file, took no timing cache or built no
            plan.
        ConfigError: TensorRT refused an optimization profile (its shapes).
    """
    said = [*notes, prepared.precision.note]
    what = f"model {request.model!r}"
    builder.create_network(prepared.precision.strongly_typed)
    errors = builder.parse_onnx(str(request.onnx))
    if errors:
        raise BuildError(f"{what}: TensorRT cannot parse {request.onnx}: " + "; ".join(errors))
    builder.create_config(request.workspace_bytes)
    for flag in prepared.precision.builder_flags:
        builder.set_precision_flag(flag)
    for k, profile in enumerate(request.profiles):
        refused = f"{what}: TensorRT refused optimization profile {k} ({profile.text()})"
        try:
            index = builder.add_profile([(r.name, r.min, r.opt, r.max) for r in profile.inputs])
        except RuntimeError as exc:  # (set_shape's: the shapes are inconsistent)
            raise ConfigError(f"{refused}: {' '.join(str(exc).split())}") from None
        if index != k:
            raise BuildError(refused)
    timing = cache.timing_cache_path(request.repository, prepared.version.text, prepared.key.device)
    data = timing.read_bytes() if timing.is_file() else b""
    if not builder.set_timing_cache(data):
        if not data or not builder.set_timing_cache(b""):
            raise BuildError(f"{what}: TensorRT refused a new timing cache")
        said.append(f"timing cache {timing} refused by TensorRT: starting a new one")
    elif data:
        said.append(f"timing cache {timing} reused ({len(data)} bytes)")
    if prepared.version.progress_monitor:
        builder.set_listener(listener)
    plan = builder.build()
    if plan is None:
        raise BuildError(f"{what}: TensorRT built no plan (its log above says why)")
    cache.save_timing_cache(timing, builder.timing_cache())
    path = cache.store(request.folder, prepared.key, plan)
    return Outcome(path, built=True, notes=tuple(said))
