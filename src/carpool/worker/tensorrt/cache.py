"""cache.py: the engine cache — where a model's TensorRT plans live and which one fits.

A plan runs only on the TensorRT release that built it and on the GPU type it was built
for; so a plan is filed under the sha256 of everything it depends on (:class:`PlanKey`):
the ONNX file's hash, the TensorRT version, the GPU's name and compute capability, the
profiles, the precision, and on a Jetson its L4T (JetPack) release::

    <model folder>/plans/<key>.plan     the serialized plan
    <model folder>/plans/<key>.json     its sidecar: the key's fields, the plan's sha256
    <repository>/.timing/<device>.cache the timing cache, one per TensorRT release and GPU,
                                        reused by every build on them

:func:`lookup` is pure apart from reading those files: a plan whose sidecar is missing,
unreadable, or names other fields, or whose bytes do not hash to the sidecar's sha256, is
a miss with the reason, never a plan handed to TensorRT. :func:`store` writes a plan and
its sidecar atomically. The device and its L4T release (:class:`Device`,
:func:`read_l4t`) are :mod:`.device`'s, named here too.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from carpool.worker.repository import PLANS_DIR
from carpool.worker.tensorrt.device import L4T_RELEASE_FILE, Device, parse_l4t, read_l4t

__all__ = [
    "L4T_RELEASE_FILE",
    "Device",
    "Hit",
    "Miss",
    "PlanKey",
    "lookup",
    "parse_l4t",
    "read_l4t",
    "save_timing_cache",
    "store",
    "timing_cache_path",
]

TIMING_DIR = ".timing"  # (a repository's scan skips folders starting with a dot)
#: Bumped when the sidecar's layout changes: an older sidecar is then a miss.
SIDECAR_FORMAT = 1


@dataclass(frozen=True, slots=True)
class PlanKey:
    """Everything a plan depends on."""

    onnx_sha256: str
    trt_version: str
    device: Device
    profiles: tuple[Any, ...]  # Profile.to_key() of each, in order (JSON values)
    precision: Mapping[str, Any]  # PrecisionPlan.to_key()

    def fields(self) -> dict[str, Any]:
        """The key as the sidecar records it (JSON values)."""
        return {
            "onnx_sha256": self.onnx_sha256,
            "trt_version": self.trt_version,
            "gpu_name": self.device.name,
            "compute_capability": list(self.device.compute_capability),
            "l4t": self.device.l4t,
            "profiles": json.loads(json.dumps(list(self.profiles))),
            "precision": json.loads(json.dumps(dict(self.precision))),
        }

    def digest(self) -> str:
        canonical = json.dumps(self.fields(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Hit:
    plan: Path


@dataclass(frozen=True, slots=True)
class Miss:
    reason: str  # why there is no plan to load, for a log line or a refusal


def _paths(folder: Path, key: PlanKey) -> tuple[Path, Path]:
    base = folder / PLANS_DIR / key.digest()
    return base.with_suffix(".plan"), base.with_suffix(".json")


def _sidecar(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _differences(fields: Mapping[str, Any], other: Mapping[str, Any]) -> list[str]:
    return [f"{k} {other.get(k)!r}" for k in fields if other.get(k) != fields[k]]


def lookup(folder: Path, key: PlanKey) -> Hit | Miss:
    """The plan of ``key`` in model folder ``folder``, or why there is none to load."""
    plan, sidecar = _paths(folder, key)
    fields = key.fields()
    if not plan.is_file():
        return Miss(_no_plan(folder, fields))
    data = _sidecar(sidecar)
    if data is None:
        return Miss(f"{plan} has no readable sidecar {sidecar.name}: not loaded")
    if data.get("format") != SIDECAR_FORMAT or data.get("key") != fields:
        found = data.get("key")
        diff = _differences(fields, found) if isinstance(found, dict) else ["its layout"]
        return Miss(f"{plan}'s sidecar names other fields ({'; '.join(diff)}): not loaded")
    try:
        digest = hashlib.sha256(plan.read_bytes()).hexdigest()
    except OSError as exc:
        return Miss(f"{plan} cannot be read: {exc}")
    if digest != data.get("plan_sha256"):
        return Miss(f"{plan} does not hash to its sidecar's plan_sha256 (truncated?): not loaded")
    return Hit(plan)


def _no_plan(folder: Path, fields: Mapping[str, Any]) -> str:
    """No plan for this key; the nearest other plan's differing fields, if any."""
    found = []
    for other in sorted((folder / PLANS_DIR).glob("*.json")):
        data = _sidecar(other)
        if data is not None and isinstance(data.get("key"), dict):
            found.append((_differences(fields, data["key"]), other))
    if not found:
        return f"no plan in {folder / PLANS_DIR} for this model, TensorRT and GPU"
    diff, nearest = min(found, key=lambda f: len(f[0]))
    return (
        f"no plan in {folder / PLANS_DIR} for this key; the nearest, {nearest.stem}, "
        f"was built for {'; '.join(diff)}"
    )


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def store(folder: Path, key: PlanKey, plan_bytes: bytes) -> Path:
    """Write ``plan_bytes`` as ``key``'s plan in model folder ``folder`` (the plan, then
    its sidecar, each by rename: a reader sees a whole plan or a miss)."""
    plan, sidecar = _paths(folder, key)
    plan.parent.mkdir(parents=True, exist_ok=True)
    _write(plan, plan_bytes)
    record = {
        "format": SIDECAR_FORMAT,
        "key": key.fields(),
        "plan_sha256": hashlib.sha256(plan_bytes).hexdigest(),
        "plan_bytes": len(plan_bytes),
    }
    _write(sidecar, (json.dumps(record, indent=1, sort_keys=True) + "\n").encode())
    return plan


def timing_cache_path(repository: Path, trt_version: str, device: Device) -> Path:
    """The timing cache of builds with this TensorRT release on this device."""
    return repository / TIMING_DIR / f"trt-{trt_version}-{device.key()}.cache"


def save_timing_cache(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    _write(path, data)
