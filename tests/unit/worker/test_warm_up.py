"""run.warm_up: one batch-1 run before serving, at a shape the model takes."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from carpool.common.shape_rules import ShapeRule
from carpool.worker.engines.base import Array
from carpool.worker.engines.synthetic import SyntheticEngine
from carpool.worker.warmup import warm_up


class Seen(SyntheticEngine):
    """Records the shape of every batch run."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.shapes: list[tuple[int, ...]] = []

    def run(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
        self.shapes.append(tuple(inputs["x"].shape))
        return super().run(inputs)


@pytest.mark.parametrize(
    ("item", "rule", "ran"),
    [
        ((4,), None, [(1, 4)]),
        ((3, -1, -1), None, []),  # nothing says which sizes it takes
        ((3, -1, -1), ShapeRule(multiple_of=(1, 1, 32, 32)), [(1, 3, 32, 32)]),  # ppocr-det
        ((-1,), ShapeRule(min_shape=(1, 40), multiple_of=(1, 32)), [(1, 64)]),
        ((-1, -1), ShapeRule(min_shape=(1, 1, 8)), [(1, 1, 8)]),  # min_shape names every dim
        # No size keeps the rule: not run (the model would fail its start-up).
        ((-1,), ShapeRule(min_shape=(1, 10), max_shape=(-1, 20), multiple_of=(1, 32)), []),
    ],
)
def test_warm_up_runs_the_smallest_shape_the_rules_allow(
    item: tuple[int, ...], rule: ShapeRule | None, ran: list[tuple[int, ...]]
) -> None:
    engine = Seen(item_shape=item, shape_rules={"x": rule} if rule else None)
    warm_up(engine)
    # The warm-up run, then the per-sample check: the same sample again, a second sample
    # alone, and both together.
    assert engine.shapes == [s for one in ran for s in (one, one, one, (2, *one[1:]))]
