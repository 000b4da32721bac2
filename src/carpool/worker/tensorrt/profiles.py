"""profiles.py: TensorRT optimization profiles from a model's config or from flags. Pure.

A profile gives every input a min, opt and max shape (dim 0 is the batch). From a model
(:func:`from_model`):

- the batch runs 1..``max_batch``, its opt the largest ``preferred_batch`` (else
  ``max_batch``); ``batches`` (``--batch MIN:OPT:MAX``) splits it into several ranges;
- a fixed dim is min = opt = max;
- an input whose pad rule lists buckets gets **one profile per bucket** (min = opt = max
  = the bucket: the broker pads every request into one), several such inputs the
  product of their buckets;
- any other dynamic dim takes its shape rule's range (``min_shape``/``max_shape``, kept
  to ``multiple_of`` steps), its opt the first warm-up shape's size (else its max); a
  dynamic dim without an upper bound is refused.

:func:`check_limits` refuses sets that make builds slow and plans large: more than
``max_profiles`` profiles, or a dim whose max/min exceeds ``max_ratio``, naming the model,
the input and the dim.

The same :class:`Profile` serves a plan: the engine reads its profiles back from the plan
(``get_tensor_profile_shape``). :func:`select_profile` picks the profile of a batch (or
refuses its shapes, naming each profile's ranges), and what the worker announces comes
from them (:func:`engine_info`: the shape rules from their min/max, ``preferred_batch``
from their opt batch sizes, ``max_batch`` their largest max batch).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from carpool.common.errors import ConfigError
from carpool.common.protocol import TensorMeta
from carpool.common.shape_rules import ShapeRule
from carpool.worker.engines.base import BadInput, EngineInfo, engine_io
from carpool.worker.tensorrt.profile_text import Shape, parse_profile

if TYPE_CHECKING:  # (the serving side imports this module without the worker's config)
    from carpool.worker.config import ModelConfig

__all__ = [
    "InputRange",
    "Limits",
    "Profile",
    "check_limits",
    "engine_info",
    "from_flags",
    "from_model",
    "max_batch",
    "preferred_batch",
    "select_profile",
    "shape_rules_from_profiles",
]


@dataclass(frozen=True, slots=True)
class InputRange:
    """One input's shapes in one profile."""

    name: str
    min: Shape
    opt: Shape
    max: Shape

    def admits(self, shape: Sequence[int]) -> bool:
        return len(shape) == len(self.min) and all(
            lo <= d <= hi for d, lo, hi in zip(shape, self.min, self.max, strict=True)
        )

    def text(self) -> str:
        """``x [1..8, 3, 48, 160..320]``."""
        dims = (
            f"{lo}" if lo == hi else f"{lo}..{hi}"
            for lo, hi in zip(self.min, self.max, strict=True)
        )
        return f"{self.name} [{', '.join(dims)}]"

    def to_key(self) -> list[object]:
        return [self.name, list(self.min), list(self.opt), list(self.max)]


@dataclass(frozen=True, slots=True)
class Profile:
    """One optimization profile: a range for every input, in the model's input order."""

    inputs: tuple[InputRange, ...]

    def admits(self, shapes: Mapping[str, Sequence[int]]) -> bool:
        return all(r.admits(shapes.get(r.name, ())) for r in self.inputs)

    def refusal(self, shapes: Mapping[str, Sequence[int]]) -> str | None:
        """Why ``shapes`` (per input) lie outside this profile, naming the input and dim;
        None when inside."""
        for r in self.inputs:
            shape = tuple(shapes.get(r.name, ()))
            if len(shape) != len(r.min):
                return f"input {r.name!r} has {len(shape)} dims, the engine takes {len(r.min)}"
            for d, (n, lo, hi) in enumerate(zip(shape, r.min, r.max, strict=True)):
                if not lo <= n <= hi:
                    dim = "the batch (dim 0)" if d == 0 else f"dim {d}"
                    return f"input {r.name!r}: {dim} is {n}, not in {lo}..{hi}"
        return None

    def range_of(self, name: str) -> InputRange:
        """Input ``name``'s range.

        Raises:
            KeyError: no such input.
        """
        for r in self.inputs:
            if r.name == name:
                return r
        raise KeyError(name)

    def max_volume(self) -> int:
        """Elements of every input at its max shape (the smaller, the tighter)."""
        return sum(math.prod(r.max) for r in self.inputs)

    def text(self) -> str:
        return ", ".join(r.text() for r in self.inputs)


@dataclass(frozen=True, slots=True)
class Limits:
    """How large a profile set may be built (``--max-profiles``, ``--max-ratio``)."""

    max_profiles: int = 8
    max_ratio: float = 16.0


def _checked(model: str, spec: TensorMeta, r: InputRange) -> InputRange:
    what = f"model {model!r}, input {spec.name!r}"
    for label, shape in (("min", r.min), ("opt", r.opt), ("max", r.max)):
        if len(shape) != len(spec.shape):
            raise ConfigError(
                f"{what}: {label} shape {list(shape)} has {len(shape)} dims, "
                f"the input has {len(spec.shape)}"
            )
    for i, fixed in enumerate(spec.shape):
        lo, opt, hi = r.min[i], r.opt[i], r.max[i]
        if not 1 <= lo <= opt <= hi:
            raise ConfigError(
                f"{what}, dim {i}: needs 1 <= min <= opt <= max, got {lo}, {opt}, {hi}"
            )
        if i and fixed != -1 and (lo, hi) != (fixed, fixed):
            raise ConfigError(f"{what}, dim {i}: is fixed at {fixed}, the profile gives {lo}..{hi}")
    return r


def from_flags(
    model: str, inputs: Sequence[TensorMeta], flags: Sequence[str]
) -> tuple[Profile, ...]:
    """One profile per ``--profile`` flag; each must name every input."""
    profiles = []
    for text in flags:
        given = parse_profile(text)
        unknown = sorted(set(given) - {t.name for t in inputs})
        if unknown:
            names = [t.name for t in inputs]
            raise ConfigError(f"--profile {text!r}: no input {unknown[0]!r}; inputs are {names}")
        missing = [t.name for t in inputs if t.name not in given]
        if missing:
            raise ConfigError(f"--profile {text!r}: gives no shapes for input(s) {missing}")
        profiles.append(
            Profile(tuple(_checked(model, t, InputRange(t.name, *given[t.name])) for t in inputs))
        )
    return tuple(profiles)


def _dim_range(config: ModelConfig, spec: TensorMeta, i: int) -> tuple[int, int, int]:
    """min, opt, max of dynamic dim ``i >= 1`` of an input without buckets."""
    declared = config.inputs.get(spec.name)
    rule = declared.rule() if declared is not None else ShapeRule()
    step = 1
    if declared is not None and declared.pad is not None and declared.pad.multiple_of:
        step = declared.pad.multiple_of[i - 1]
    if rule.multiple_of:
        step = math.lcm(step, rule.multiple_of[i])
    hi = rule.max_shape[i] if rule.max_shape else -1
    if hi == -1:
        raise ConfigError(
            f"model {config.name!r}, input {spec.name!r}, dim {i} is dynamic with no upper "
            f"bound: give [inputs.{spec.name}] max_shape or buckets, or [tensorrt] profiles, "
            "in its model.toml, or --profile flags"
        )
    lo = rule.min_shape[i] if rule.min_shape else 1
    lo, hi = -(-lo // step) * step, hi // step * step
    if lo > hi:
        raise ConfigError(
            f"model {config.name!r}, input {spec.name!r}, dim {i}: no size in "
            f"{rule.min_shape[i] if rule.min_shape else 1}..{rule.max_shape[i]} "
            f"is a multiple of {step}"
        )
    runs = config.warmup.get(spec.name, ())
    opt = runs[0][i] if runs and len(runs[0]) > i and lo <= runs[0][i] <= hi else hi
    return lo, opt, hi


def from_model(
    config: ModelConfig,
    inputs: Sequence[TensorMeta],
    batches: Sequence[tuple[int, int, int]] = (),
) -> tuple[Profile, ...]:
    """The profiles of a model (see the module docstring), in order: batch ranges, then
    buckets (the first input's first bucket first).

    Raises:
        ConfigError: a dim that cannot be given a range, or a batch range above max_batch.
    """
    top = config.max_batch
    if not batches:
        batches = [(1, max(config.preferred_batch, default=top), top)]
    for lo, _, hi in batches:
        if hi > top:
            raise ConfigError(
                f"model {config.name!r}: --batch {lo}..{hi} is above its max_batch {top}"
            )
    per_input: list[list[InputRange]] = []  # each input's item ranges (batch dim 1..1)
    for spec in inputs:
        declared = config.inputs.get(spec.name)
        buckets = declared.pad.buckets if declared is not None and declared.pad else ()
        if buckets:
            per_input.append([InputRange(spec.name, (1, *b), (1, *b), (1, *b)) for b in buckets])
            continue
        ranges = [
            (d, d, d) if d != -1 else _dim_range(config, spec, i)
            for i, d in enumerate(spec.shape)
            if i
        ]
        lows, opts, highs = (tuple(r[k] for r in ranges) for k in range(3))
        per_input.append([InputRange(spec.name, (1, *lows), (1, *opts), (1, *highs))])
    return tuple(
        Profile(
            tuple(
                _checked(config.name, spec, _with_batch(r, batch))
                for spec, r in zip(inputs, combo, strict=True)
            )
        )
        for batch in batches
        for combo in itertools.product(*per_input)
    )


def _with_batch(r: InputRange, batch: tuple[int, int, int]) -> InputRange:
    lo, opt, hi = batch
    return InputRange(r.name, (lo, *r.min[1:]), (opt, *r.opt[1:]), (hi, *r.max[1:]))


def check_limits(model: str, profiles: Sequence[Profile], limits: Limits) -> None:
    """Refuse a set that would make the build slow and the plan large.

    Raises:
        ConfigError: more than ``limits.max_profiles`` profiles, or a dim (the batch
            included) whose max/min exceeds ``limits.max_ratio``; the message names the
            model, the input and the dim.
    """
    if not profiles:
        raise ConfigError(f"model {model!r}: no optimization profiles")
    if len(profiles) > limits.max_profiles:
        raise ConfigError(
            f"model {model!r}: {len(profiles)} optimization profiles, more than "
            f"{limits.max_profiles} (each profile adds build time and plan size); the "
            "count is its buckets times its --batch ranges: merge buckets, or raise "
            "--max-profiles"
        )
    for k, profile in enumerate(profiles):
        for r in profile.inputs:
            for i, (lo, hi) in enumerate(zip(r.min, r.max, strict=True)):
                if hi / lo > limits.max_ratio:
                    dim = "dim 0 (the batch)" if i == 0 else f"dim {i}"
                    fix = "split the batch with --batch ranges" if i == 0 else "use buckets"
                    raise ConfigError(
                        f"model {model!r}, input {r.name!r}, {dim}: profile {k} spans "
                        f"{lo}..{hi}, max/min {hi / lo:g} is above {limits.max_ratio:g} "
                        f"(kernels tuned for one end run slowly at the other): {fix}, "
                        "or raise --max-ratio"
                    )


def select_profile(profiles: Sequence[Profile], shapes: Mapping[str, Sequence[int]]) -> int:
    """The index of the profile a batch of these input shapes runs in: of those that admit
    it, the one whose max shapes are smallest (kernels tuned for the nearest sizes), the
    first of equals.

    Raises:
        BadInput: no profile admits the shapes; the message gives each profile's ranges
            and the dim it refuses.
    """
    admitting = [k for k, p in enumerate(profiles) if p.admits(shapes)]
    if admitting:
        return min(admitting, key=lambda k: (profiles[k].max_volume(), k))
    given = ", ".join(f"{name} {list(shape)}" for name, shape in shapes.items())
    reasons = "; ".join(
        f"profile {k} takes {p.text()}: {p.refusal(shapes)}" for k, p in enumerate(profiles)
    )
    raise BadInput(f"shapes {given} lie outside every optimization profile ({reasons})")


def shape_rules_from_profiles(profiles: Sequence[Profile]) -> dict[str, ShapeRule]:
    """Per input, the broker's rule: the least min and the greatest max of each dim over
    the profiles (dim 0's entries are not applied: the batch is bounded by max_batch).
    Between profiles that do not touch, a shape inside this span but in no profile passes
    the broker and is refused by the engine (:func:`select_profile`)."""
    rules: dict[str, ShapeRule] = {}
    for r in profiles[0].inputs:
        ranges = [p.range_of(r.name) for p in profiles]
        lo = tuple(min(x.min[i] for x in ranges) for i in range(len(r.min)))
        hi = tuple(max(x.max[i] for x in ranges) for i in range(len(r.max)))
        rules[r.name] = ShapeRule(lo, hi)
    return rules


def preferred_batch(profiles: Sequence[Profile]) -> tuple[int, ...]:
    """The batch sizes the profiles are tuned for (each one's opt batch), ascending."""
    return tuple(sorted({min(r.opt[0] for r in p.inputs) for p in profiles if p.inputs}))


def max_batch(profiles: Sequence[Profile]) -> int:
    """The largest batch some profile takes (for every input)."""
    return max(min(r.max[0] for r in p.inputs) for p in profiles)


def engine_info(
    inputs: Sequence[TensorMeta],
    outputs: Sequence[TensorMeta],
    profiles: Sequence[Profile],
    what: str,
) -> EngineInfo:
    """What a worker announces for a plan with these tensors and profiles: ``max_batch``
    from the profiles' max batch, ``preferred_batch`` their opt batch sizes, each input's
    shape rule the span of their min..max, and a warm-up run per profile at its opt shapes.

    Raises:
        ConfigError: no profiles, or a tensor without a dynamic batch dim.
    """
    if not profiles:
        raise ConfigError(f"{what}: the plan has no optimization profile")
    for kind, tensors in (("input", inputs), ("output", outputs)):
        for t in tensors:
            if not t.shape or t.shape[0] != -1:
                raise ConfigError(
                    f"{what}: {kind} {t.name!r} has shape {list(t.shape)}; carpool needs a "
                    "dynamic batch dim 0 (build the engine from an ONNX model whose dim 0 is "
                    "symbolic)"
                )
    rules = shape_rules_from_profiles(profiles)
    io = engine_io(inputs, outputs, max_batch(profiles), preferred_batch(profiles))
    return EngineInfo(
        replace(io, rules=tuple(rules[t.name] for t in inputs)),
        warmup=tuple(tuple(p.range_of(t.name).opt for t in inputs) for p in profiles),
    )
