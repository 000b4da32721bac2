"""ready.py: READY — a worker announces itself and the models it serves — pure.

:class:`Ready` and its :class:`ModelSpec` list: each model's inputs and outputs, batch
limits, shape rules (common/shape_rules.py), and how its requests are padded into buckets
and its outputs cropped back (common/padding.py); their encoders and decoders.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from carpool.common.errors import ProtocolError
from carpool.common.padding import CropAxis, PadRule
from carpool.common.protocol.frames import (
    MAX_MODELS,
    TensorMeta,
    require_field,
    require_map,
    require_name,
    tensor_list,
)
from carpool.common.shape_rules import ShapeRule


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What a worker serves for one model: I/O specs (dim 0 is the batch) and batch limits."""

    name: str
    inputs: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]
    max_batch: int
    # Batch sizes the engine runs best at (TensorRT profile sizes); empty means any.
    preferred_batch: tuple[int, ...] = ()
    # Limits on each input's dims beyond its shape, in input order; () when none has any.
    rules: tuple[ShapeRule | None, ...] = ()
    # How each input's requests are padded into buckets (common/padding.py), in input
    # order; () when none is padded.
    pads: tuple[PadRule | None, ...] = ()
    # How each output is cropped back to a request's own extent, in output order (the
    # axes it crops; empty: none); () when no output is cropped.
    crops: tuple[tuple[CropAxis, ...], ...] = ()

    def to_wire(self) -> dict[str, Any]:
        inputs = [t.to_wire() for t in self.inputs]
        for descriptor, rule in zip(inputs, self.rules or [None] * len(inputs), strict=True):
            if rule:
                descriptor.update(rule.to_wire())
        for descriptor, pad in zip(inputs, self.pads or [None] * len(inputs), strict=True):
            if pad is not None:
                descriptor["pad"] = pad.to_wire()
        outputs = [t.to_wire() for t in self.outputs]
        for descriptor, axes in zip(outputs, self.crops or [()] * len(outputs), strict=True):
            if axes:
                descriptor["crop"] = [c.to_wire() for c in axes]
        return {
            "name": self.name,
            "inputs": inputs,
            "outputs": outputs,
            "max_batch": self.max_batch,
            "preferred_batch": list(self.preferred_batch),
        }

    @classmethod
    def from_wire(cls, obj: Any) -> ModelSpec:
        m = require_map(obj, "model spec")
        name = require_name(m.get("name"), "model spec")
        inputs = tensor_list(m.get("inputs"), f"model {name} inputs", allow_dynamic=True)
        rules = tuple(
            ShapeRule.from_wire(d, len(t.shape), f"model {name} input {t.name!r}")
            for d, t in zip(m["inputs"], inputs, strict=True)
        )
        outputs = tensor_list(m.get("outputs"), f"model {name} outputs", allow_dynamic=True)
        pads, crops = _padding(name, m["inputs"], inputs, m["outputs"], outputs)
        max_batch = require_field(m, "max_batch", int, f"model {name}")
        if max_batch < 1:
            raise ProtocolError(f"model {name}: max_batch must be >= 1")
        preferred = m.get("preferred_batch", [])
        if not isinstance(preferred, list) or not all(
            isinstance(p, int) and not isinstance(p, bool) and 1 <= p <= max_batch
            for p in preferred
        ):
            raise ProtocolError(f"model {name}: preferred_batch must list ints in 1..max_batch")
        return cls(
            name,
            inputs,
            outputs,
            max_batch,
            tuple(sorted(set(preferred))),
            rules if any(rules) else (),
            pads,
            crops,
        )


def _padding(
    name: str,
    raw_inputs: list[dict[str, Any]],
    inputs: tuple[TensorMeta, ...],
    raw_outputs: list[dict[str, Any]],
    outputs: tuple[TensorMeta, ...],
) -> tuple[tuple[PadRule | None, ...], tuple[tuple[CropAxis, ...], ...]]:
    """The pad rules of a model spec's inputs and the crop axes of its outputs (§8.1)."""
    pads = tuple(
        None
        if "pad" not in d
        else PadRule.from_wire(d["pad"], len(t.shape) - 1, f"model {name} input {t.name!r}")
        for d, t in zip(raw_inputs, inputs, strict=True)
    )
    ranks = {t.name: len(t.shape) for t in inputs}
    crops: list[tuple[CropAxis, ...]] = []
    for d, t in zip(raw_outputs, outputs, strict=True):
        what = f"model {name} output {t.name!r}"
        raw = d.get("crop", [])
        if not isinstance(raw, list):
            raise ProtocolError(f"{what}: crop must be a list")
        axes = tuple(CropAxis.from_wire(c, what) for c in raw)
        problems = [p for c in axes for p in c.problems(len(t.shape), ranks)]
        if len({c.axis for c in axes}) != len(axes):
            problems.append("an axis is cropped twice")
        if problems:
            raise ProtocolError(f"{what}: " + "; ".join(problems))
        crops.append(axes)
    if any(crops) and not any(pads):
        raise ProtocolError(f"model {name}: outputs are cropped but no input is padded")
    return (pads if any(p is not None for p in pads) else ()), (tuple(crops) if any(crops) else ())


@dataclass(frozen=True, slots=True)
class Ready:
    """READY meta: a worker announces itself and what it serves."""

    name: str
    # How many batches the broker may have outstanding at this worker (credits).
    slots: int
    models: tuple[ModelSpec, ...]
    # The worker's heartbeat interval; the broker heartbeats it at the same rate.
    heartbeat_ms: int = 1000

    def to_wire(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "slots": self.slots,
            "models": [m.to_wire() for m in self.models],
            "heartbeat_ms": self.heartbeat_ms,
        }

    @classmethod
    def from_wire(cls, meta: dict[str, Any]) -> Ready:
        name = require_name(meta.get("name"), "ready")
        slots = require_field(meta, "slots", int, "ready")
        if not 1 <= slots <= 1024:
            raise ProtocolError("ready: slots must be in 1..1024")
        models = meta.get("models")
        if not isinstance(models, list) or not models or len(models) > MAX_MODELS:
            raise ProtocolError(f"ready: models must be a list of 1..{MAX_MODELS} model specs")
        specs = tuple(ModelSpec.from_wire(m) for m in models)
        if len({s.name for s in specs}) != len(specs):
            raise ProtocolError("ready: duplicate model names")
        heartbeat_ms = meta.get("heartbeat_ms", 1000)
        if isinstance(heartbeat_ms, bool) or not isinstance(heartbeat_ms, int):
            raise ProtocolError("ready: heartbeat_ms must be an int")
        if not 10 <= heartbeat_ms <= 600_000:
            raise ProtocolError("ready: heartbeat_ms must be in 10..600000")
        return cls(name, slots, specs, heartbeat_ms)
