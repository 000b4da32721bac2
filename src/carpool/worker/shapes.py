"""shapes.py: what a model's config declares about its tensors' shapes, checked against the
model's real inputs and outputs and put into its :class:`EngineInfo`.

A model's TOML (a repository's ``model.toml`` or a ``[[models]]`` table of worker.toml,
docs/models.md) may declare, per input (``[inputs.NAME]``), a shape rule (``min_shape``,
``max_shape``, ``multiple_of``: protocol §8.1) and a pad rule (``[inputs.NAME.pad]``:
:class:`~carpool.common.padding.PadRule`); per output (``[outputs.NAME]``) the axes
cropped back to a request's extent (``crop``: :class:`~carpool.common.padding.CropAxis`);
and the shapes its warm-up runs on (``warmup``: full input shapes, dim 0 included, by
input name). :func:`problems` says what of that does not fit the model, each problem as
the key it is about and the rule it breaks; :func:`declare` puts it into an engine's
info or raises. Pure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from carpool.common import shape_rules
from carpool.common.errors import ConfigError
from carpool.common.padding import MAX_BUCKETS, CropAxis, PadRule
from carpool.common.protocol import TensorMeta
from carpool.common.shape_rules import ShapeRule
from carpool.worker.engines.base import EngineInfo

__all__ = ["CropConfig", "InputConfig", "ModelShapes", "OutputConfig", "declare", "problems"]

#: Fields whose name a problem message of ShapeRule, PadRule or CropAxis may start with:
#: such a message is reported under that key ("multiple_of has 2 entries" becomes
#: "inputs.x.pad.multiple_of: has 2 entries").
_FIELDS = ("min_shape", "max_shape", "multiple_of", "buckets", "axis", "input_axis", "scale")


@dataclass(frozen=True, slots=True)
class InputConfig:
    """``[inputs.NAME]``: one input's shape rule (each list as long as its shape, entry
    0 not applied) and pad rule (item shapes: without dim 0)."""

    min_shape: tuple[int, ...] = ()
    max_shape: tuple[int, ...] = ()
    multiple_of: tuple[int, ...] = ()
    pad: PadRule | None = None

    def rule(self) -> ShapeRule:
        return ShapeRule(self.min_shape, self.max_shape, self.multiple_of)


@dataclass(frozen=True, slots=True)
class CropConfig:
    """One entry of ``[outputs.NAME] crop``: output axis ``axis`` has the extent of input
    ``input``'s axis ``input_axis`` times ``scale = [numerator, denominator]``."""

    axis: int
    input: str
    input_axis: int
    scale: tuple[int, ...] = (1, 1)

    def crop_axis(self) -> CropAxis:
        numerator, denominator = self.scale
        return CropAxis(self.axis, self.input, self.input_axis, numerator, denominator)


@dataclass(frozen=True, slots=True)
class OutputConfig:
    """``[outputs.NAME]``: the axes of one output cropped back to a request's extent."""

    crop: tuple[CropConfig, ...] = ()


@dataclass(frozen=True, slots=True)
class ModelShapes:
    """A model's shape declarations, by tensor name (see the module docstring)."""

    inputs: Mapping[str, InputConfig] = field(default_factory=dict)
    outputs: Mapping[str, OutputConfig] = field(default_factory=dict)
    warmup: Mapping[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict)


def _keyed(key: str, message: str) -> tuple[str, str]:
    """A rule's problem under the key it is about: the field its message starts with."""
    message = message.removeprefix("crop ")
    word, _, rest = message.partition(" ")
    if word == "bucket":  # ("bucket [3, 48] has 2 dims, ...": one of the buckets)
        return f"{key}.buckets", message
    if word in _FIELDS and rest:
        return f"{key}.{word}", rest
    return key, message


def problems(
    shapes: ModelShapes,
    inputs: Sequence[TensorMeta],
    outputs: Sequence[TensorMeta],
    max_batch: int,
) -> list[tuple[str, str]]:
    """What of ``shapes`` does not fit a model of these inputs and outputs, as (key, rule)
    pairs: ``("inputs.x.pad.multiple_of", "has 2 entries, the input has 3 dims after the
    batch dim")``. Empty when everything fits."""
    found: list[tuple[str, str]] = []
    by_name = {t.name: t for t in inputs}
    names = [t.name for t in inputs]
    for name, config in shapes.inputs.items():
        key = f"inputs.{name}"
        spec = by_name.get(name)
        if spec is None:
            found.append((key, f"no input {name!r}; the model's inputs are {names}"))
            continue
        rule = config.rule()
        rule_problems = rule.problems(len(spec.shape))
        found += [_keyed(key, p) for p in rule_problems]
        if config.pad is not None:
            found += _pad_problems(f"{key}.pad", config.pad, spec, None if rule_problems else rule)
    out_ranks = {t.name: len(t.shape) for t in outputs}
    in_ranks = {t.name: len(t.shape) for t in inputs}
    out_by_name = {t.name: t for t in outputs}
    for name, output in shapes.outputs.items():
        key = f"outputs.{name}"
        if name not in out_ranks:
            found.append((key, f"no output {name!r}; the model's outputs are {list(out_ranks)}"))
            continue
        axes: set[int] = set()
        for k, crop in enumerate(output.crop):
            where = f"{key}.crop[{k}]"
            if len(crop.scale) != 2:
                found.append((f"{where}.scale", f"is [numerator, denominator], got {crop.scale}"))
                continue
            axis = crop.crop_axis()
            crop_problems = axis.problems(out_ranks[name], in_ranks)
            found += [_keyed(where, p) for p in crop_problems]
            if crop_problems:
                continue
            if crop.axis in axes:
                found.append((f"{where}.axis", f"{crop.axis} is cropped twice"))
            axes.add(crop.axis)
            fixed = out_by_name[name].shape[crop.axis]
            if fixed != -1:
                found.append(
                    (f"{where}.axis", f"output axis {crop.axis} is fixed at {fixed}, not dynamic")
                )
    found += _warmup_problems(shapes, inputs, max_batch)
    return found


def _pad_problems(
    key: str, pad: PadRule, spec: TensorMeta, rule: ShapeRule | None
) -> list[tuple[str, str]]:
    """A pad rule's own problems, then whether its buckets fit the input's fixed dims and
    its shape rule (a bucket is a shape the engine runs)."""
    item = spec.shape[1:]
    own = pad.problems(len(item))
    if own:
        return [_keyed(key, p) for p in own]
    found = []
    # (multiple_of is empty or has one step per item dim)
    for i, (step, dim) in enumerate(zip(pad.multiple_of, item, strict=False), 1):
        if dim != -1 and dim % step:
            found.append(
                (f"{key}.multiple_of", f"dim {i} is fixed at {dim}, not a multiple of {step}")
            )
    for b in pad.buckets:
        fixed = [
            (i, d, s) for i, (d, s) in enumerate(zip(item, b, strict=True), 1) if d not in (-1, s)
        ]
        if fixed:
            i, d, s = fixed[0]
            found.append((f"{key}.buckets", f"bucket {list(b)} has {s} in dim {i}, fixed at {d}"))
        elif rule is not None and (why := rule.violation((1, *b))) is not None:
            found.append(
                (f"{key}.buckets", f"bucket {list(b)} breaks the input's shape rule: {why}")
            )
    return found


def _warmup_problems(
    shapes: ModelShapes, inputs: Sequence[TensorMeta], max_batch: int
) -> list[tuple[str, str]]:
    if not shapes.warmup:
        return []
    by_name = {t.name: t for t in inputs}
    missing = [n for n in by_name if n not in shapes.warmup]
    found = [
        (f"warmup.{name}", f"no input {name!r}; the model's inputs are {list(by_name)}")
        for name in shapes.warmup
        if name not in by_name
    ]
    if missing:
        found.append(
            ("warmup", f"has no shapes for input(s) {missing}: each run needs every input")
        )
    counts = {len(v) for v in shapes.warmup.values()}
    if len(counts) > 1:
        found.append(("warmup", f"inputs have {sorted(counts)} shapes; each run takes one of each"))
    if max(counts) > MAX_BUCKETS:
        found.append(("warmup", f"at most {MAX_BUCKETS} runs, got {max(counts)}"))
    for name, runs in shapes.warmup.items():
        spec = by_name.get(name)
        if spec is None:
            continue
        config = shapes.inputs.get(name, InputConfig())
        for k, shape in enumerate(runs):
            why = _warmup_shape(shape, spec, max_batch, config)
            if why:
                found.append((f"warmup.{name}[{k}]", why))
    return found


def _warmup_shape(
    shape: tuple[int, ...], spec: TensorMeta, max_batch: int, config: InputConfig
) -> str | None:
    """Why one warm-up shape cannot be run, or None."""
    if len(shape) != len(spec.shape):
        return f"{list(shape)} has {len(shape)} dims, the input has {len(spec.shape)}"
    if not 1 <= shape[0] <= max_batch:
        return f"{list(shape)}: dim 0 (the batch) must lie in 1..max_batch ({max_batch})"
    for i, (d, s) in enumerate(zip(spec.shape, shape, strict=True)):
        if s < 1 or (i and d not in (-1, s)):
            return f"{list(shape)}: dim {i} is {s}, the input's is {d}"
    rule = config.rule()
    why = None if rule.problems(len(shape)) else rule.violation(shape)
    if why:
        return f"{list(shape)} breaks the input's shape rule: {why}"
    pad = config.pad
    if pad is not None and not pad.problems(len(shape) - 1) and pad.bucket(shape[1:]) != shape[1:]:
        return f"{list(shape)} is not a bucket of the input's pad rule (requests run padded to one)"
    return None


def declare(info: EngineInfo, shapes: ModelShapes, what: str) -> EngineInfo:
    """``info`` with the shape rules, pad rules, crops and warm-up shapes of ``shapes``
    (a rule declared for an input replaces the one ``info`` has).

    Raises:
        ConfigError: something in ``shapes`` does not fit the engine's inputs or outputs.
    """
    found = problems(shapes, info.io.inputs, info.io.outputs, info.io.max_batch)
    if found:
        raise ConfigError(f"{what}: " + "; ".join(f"{key}: {rule}" for key, rule in found))
    names = [t.name for t in info.io.inputs]
    rules = {n: r for n, r in zip(names, info.io.rules, strict=False) if r is not None}
    rules.update({n: c.rule() for n, c in shapes.inputs.items() if c.rule()})
    pads = tuple(getattr(shapes.inputs.get(n), "pad", None) for n in names)
    crops = tuple(
        tuple(c.crop_axis() for c in shapes.outputs[t.name].crop)
        if t.name in shapes.outputs
        else ()
        for t in info.io.outputs
    )
    runs = len(next(iter(shapes.warmup.values()), ()))
    warmup = tuple(tuple(shapes.warmup[n][k] for n in names) for k in range(runs))
    io = dataclasses.replace(
        info.io,
        rules=shape_rules.align(names, [len(t.shape) for t in info.io.inputs], rules, what),
        pads=pads if any(pads) else (),
        crops=crops if any(crops) else (),
    )
    return EngineInfo(io, warmup)
