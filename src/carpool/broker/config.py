"""config.py: BrokerConfig and its parts; defaults live here and nowhere else. Pure."""

from __future__ import annotations

from dataclasses import dataclass, field

from carpool.common.config import check


@dataclass(frozen=True, slots=True)
class BatchingConfig:
    """The minibus rule: leave when ``max_batch`` samples are aboard or the oldest request
    has waited ``max_wait_s``."""

    max_batch: int = 8
    max_wait_s: float = 0.005

    def __post_init__(self) -> None:
        problems = []
        if not 1 <= self.max_batch <= 4096:
            problems.append(f"max_batch must be in 1..4096, got {self.max_batch}")
        if not 0.0 <= self.max_wait_s <= 60.0:
            problems.append(f"max_wait_s must be in 0..60, got {self.max_wait_s}")
        check(problems, "batching")


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    frontend: str = "tcp://127.0.0.1:5555"  # clients connect here
    backend: str = "tcp://127.0.0.1:5556"  # workers connect here
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    # Per-model overrides of `batching`, by model name.
    models: dict[str, BatchingConfig] = field(default_factory=dict)
    default_timeout_s: float = 10.0  # for requests that carry no timeout_ms
    max_queued: int = 10_000  # requests queued across all models; more are OVERLOADED
    liveness: int = 3  # heartbeat intervals of silence before a worker is gone
    max_attempts: int = 2  # dispatches of one request before a lost worker fails it

    def __post_init__(self) -> None:
        problems = []
        if not 0.001 <= self.default_timeout_s <= 3600:
            problems.append("default_timeout_s must be in 0.001..3600")
        if self.max_queued < 1:
            problems.append("max_queued must be >= 1")
        if not 1 <= self.liveness <= 100:
            problems.append("liveness must be in 1..100")
        if not 1 <= self.max_attempts <= 10:
            problems.append("max_attempts must be in 1..10")
        check(problems, "broker")

    def batching_for(self, model: str) -> BatchingConfig:
        return self.models.get(model, self.batching)
