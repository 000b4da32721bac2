"""results.py: InferResult — what a request's answer holds (both twins give it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from numpy.typing import NDArray

__all__ = ["InferResult"]


@dataclass(frozen=True, slots=True)
class InferResult:
    """The outputs of one request and where its time went."""

    outputs: dict[str, NDArray[Any]]
    batch_size: int = 0  # samples in the batch this request rode in
    queue_ms: float = 0.0  # time queued at the broker
    compute_ms: float = 0.0  # engine time of the batch

    def __getitem__(self, name: str) -> NDArray[Any]:
        return self.outputs[name]
