"""config.py: BrokerConfig and its parts; defaults live here and nowhere else. Pure."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from carpool.common.config import MAX_BATCH_CEILING, check, out_of_range
from carpool.common.link import link_path
from carpool.common.listen import listen_problems

POLICIES = ("carpool", "fixed", "seed")


@dataclass(frozen=True, slots=True)
class BatchingConfig:
    """How batches form for a model.

    ``policy``:
      * ``carpool`` (default): deadline-aware — earliest deadline first with two priorities,
        hopeless requests shed at once, the wait bounded by the SLA countdown, and each
        wait following the worker's backlog and the batch's fitted cost, the fleet's own
        CPU per batch included (docs/batching.md).
      * ``fixed``: the minibus rule with fixed B_max/T_max, FIFO (what Triton configures).
      * ``seed``: ``fixed`` plus the seeds' ρ rule (busy → smaller B_max), for comparison.
    """

    max_batch: int = 8  # B_max: the cap on samples per batch
    max_wait_s: float = 0.005  # T_max: longest wait of the oldest request
    policy: str = "carpool"
    margin_s: float = 0.002  # safety margin of the SLA countdown
    target_rho: float = 0.5  # seed policy: the ρ its rule steers around
    learning_rate: float = 0.5  # seed policy: η, the learning rate of its ρ step
    adapt_interval_s: float = 0.5  # at most one B_max step per interval
    # carpool policy: the share of a request's timeout kept in reserve at the door (a
    # request is let in when its predicted completion, stretched by the spread of batch
    # times, falls within the rest), so that one let in makes its deadline.
    admit_headroom: float = 0.1

    def __post_init__(self) -> None:
        check(_batching_problems(self), "batching")


@dataclass(frozen=True, slots=True)
class BatchingOverride:
    """A ``[models.<name>]`` table: the keys of ``[batching]`` it sets for that one model.

    A key left unset (None) is not a default: it comes from ``BrokerConfig.batching`` as
    finally configured (the file's ``[batching]`` plus the command line's ``--policy``,
    ``--max-wait-ms``, ``--max-batch``), merged on every look-up by
    ``BrokerConfig.batching_for``. The keys it does set win over both. Its values are
    checked by the BrokerConfig that holds it (the errors name the model).
    """

    max_batch: int | None = None
    max_wait_s: float | None = None
    policy: str | None = None
    margin_s: float | None = None
    target_rho: float | None = None
    learning_rate: float | None = None
    adapt_interval_s: float | None = None
    admit_headroom: float | None = None

    def settings(self) -> dict[str, Any]:
        """The keys this table sets, with their values."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        }

    def over(self, base: BatchingConfig) -> BatchingConfig:
        """``base`` with the keys this table sets replaced."""
        return dataclasses.replace(base, **self.settings())


def _batching_problems(b: BatchingConfig | BatchingOverride) -> list[str]:
    """What is wrong with the keys ``b`` sets (an override's unset keys pass)."""
    problems = []
    if b.max_batch is not None and not 1 <= b.max_batch <= MAX_BATCH_CEILING:
        problems.append(f"max_batch must be in 1..{MAX_BATCH_CEILING}, got {b.max_batch}")
    if b.max_wait_s is not None and not 0.0 <= b.max_wait_s <= 60.0:
        problems.append(f"max_wait_s must be in 0..60, got {b.max_wait_s}")
    if b.policy is not None and b.policy not in POLICIES:
        problems.append(f"policy must be one of {', '.join(POLICIES)}, got {b.policy!r}")
    if b.margin_s is not None and not 0.0 <= b.margin_s <= 10.0:
        problems.append("margin_s must be in 0..10")
    if b.target_rho is not None and not 0.05 <= b.target_rho <= 1.0:
        problems.append("target_rho must be in 0.05..1")
    if b.learning_rate is not None and not 0.0 < b.learning_rate <= 1.0:
        problems.append("learning_rate must be in (0, 1] (larger steps overshoot)")
    if b.adapt_interval_s is not None and not 0.0 <= b.adapt_interval_s <= 60.0:
        problems.append("adapt_interval_s must be in 0..60")
    if b.admit_headroom is not None and not 0.0 <= b.admit_headroom <= 0.9:
        problems.append(f"admit_headroom must be in 0..0.9, got {b.admit_headroom}")
    return problems


@dataclass(frozen=True, slots=True)
class CurveConfig:
    """``[curve]``: CURVE encryption and key authentication on both ZeroMQ sockets
    (docs/security.md). Key files are made by ``carpool keygen``; an allow-list is a
    directory of public ``*.key`` files, read again on SIGHUP."""

    enabled: bool = False
    server_key: str = ""  # the broker's NAME.key_secret (mode 0600)
    clients: str = ""  # allow-list of the keys that may connect to the frontend
    workers: str = ""  # allow-list of the keys that may connect to the backend
    # Keys whose STATS are answered (they may connect to the frontend too); "": none.
    operators: str = ""
    # Authentication failures logged per minute at most (then one line with the count).
    failure_logs_per_min: int = 10

    def __post_init__(self) -> None:
        problems = []
        if self.enabled:
            missing = [k for k in ("server_key", "clients", "workers") if not getattr(self, k)]
            if missing:
                problems.append(f"enabled needs {', '.join(missing)}")
            else:
                problems += _shared_dirs(self)
        problems += out_of_range(self, {"failure_logs_per_min": (1, 100_000)})
        check(problems, "curve")


def _same_dir(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _shared_dirs(c: CurveConfig) -> list[str]:
    """The allow-lists that name one directory: each must be its own, so that a key
    added to one list (a client's) is never on another (the workers', the operators')."""
    pairs = {("clients", "workers"): "a client key must never register as a worker"}
    if c.operators:
        pairs[("operators", "clients")] = "every client would read STATS"
        pairs[("operators", "workers")] = "a worker key would connect to the frontend"
    return [
        f"{a} and {b} must be different directories ({why})"
        for (a, b), why in pairs.items()
        if _same_dir(getattr(c, a), getattr(c, b))
    ]


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    frontend: str = "tcp://127.0.0.1:5555"  # clients connect here
    backend: str = "tcp://127.0.0.1:5556"  # workers connect here
    # Workers on this host may connect here instead: ``unix:PATH``, a plain unix stream
    # socket (carpool.common.link), one wake-up a hop instead of ZeroMQ's three. "": none.
    local_backend: str = ""
    # The local endpoint's socket file gets this group (the broker must belong to it) and
    # mode 0660: workers that run as other users (systemd DynamicUser=) join that group.
    local_backend_group: str | None = None
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    # Per-model overrides of `batching`, by model name: each sets only some keys, and the
    # rest come from `batching` (see BatchingOverride; read them with batching_for).
    models: dict[str, BatchingOverride] = field(default_factory=dict)
    default_timeout_s: float = 10.0  # for requests that carry no timeout_ms
    max_queued: int = 10_000  # requests queued across all models; more are OVERLOADED
    # Their payload bytes too (MiB; inputs in shared memory count nothing here): 10,000
    # camera frames of 6 MB would be 60 GB, and a Jetson shares its RAM with its GPU.
    max_queued_mib: int = 4096
    # What one client connection (routing id) may hold at once, queued or at workers:
    # requests, and their payload bytes (MiB). More are OVERLOADED, so one client cannot
    # take the whole queue (max_queued, max_queued_mib) from the others.
    max_client_requests: int = 2048
    max_client_mib: int = 1024
    # Models one READY may announce; a READY with more is refused with DISCONNECT.
    max_models_per_worker: int = 64
    max_workers: int = 1024  # registered at once; a READY past it is refused the same way
    # A model no live worker has served for this long is forgotten (its spec, policy,
    # queues and counters): its name answers NOT_FOUND again, and names that workers
    # announced and left cannot pile up. Models named under [models] are kept.
    forget_unserved_s: float = 60.0
    liveness: int = 3  # heartbeat intervals of silence before a worker is gone
    max_attempts: int = 2  # dispatches of one request before a lost worker fails it
    # The engine watchdog: a batch running longer than max(watchdog_factor × its predicted
    # time, predicted + watchdog_slack_s) marks its worker unhealthy (no more batches until
    # it shows progress) and its requests go to other workers as a lost worker's do. The
    # prediction is the worker's fitted cost, else another worker's of the model; with
    # none (the model's first batches) a batch may run until its last deadline.
    watchdog_factor: float = 5.0
    watchdog_slack_s: float = 1.0
    # Largest frame a client may send (ZMQ_MAXMSGSIZE on the frontend; 0: no limit). A
    # client that announces a larger one is disconnected by libzmq before it is buffered.
    max_frame_mib: int = 2048
    # On SIGTERM: queued requests are answered UNAVAILABLE at once; batches already at
    # workers get this long to finish (their results still reach clients), then the rest
    # are answered UNAVAILABLE too and workers are told DISCONNECT.
    stop_grace_s: float = 2.0
    # Then the frontend stays open, every message read and answered (UNAVAILABLE with
    # retry), until every client connection has been quiet for stop_quiet_s, or
    # stop_drain_s after the grace at most; a last read (stop_quiet_s at most), and it
    # closes. stop_grace_s + stop_drain_s + stop_quiet_s (plus a second for the last
    # answers to leave) must stay within the unit's TimeoutStopSec (10 s): raise it
    # with them.
    stop_quiet_s: float = 0.2
    stop_drain_s: float = 2.0
    # After a (re)start, for this long a model no worker has registered yet is answered
    # UNAVAILABLE (retry) rather than NOT_FOUND: its workers may still be reconnecting
    # (they notice a broker that vanished after `liveness` heartbeats). Requests for a
    # model named under [models] or in the last trace wait for its READY instead, while
    # their deadlines and the queue limits allow (holding.py, protocol §11.1).
    register_grace_s: float = 5.0
    # ZMTP heartbeats on both sockets: a PING every peer_heartbeat_s, and a connection
    # with no traffic for peer_timeout_s after one is closed. Without them a peer whose
    # host lost power or network would keep its descriptor and buffers for ever (the
    # kernel sees an idle TCP connection): a thousand such robots would fill the default
    # fd limit and the broker would take no new client. libzmq answers PINGs by itself (ZMTP 3.1,
    # libzmq 4.2 and later). 0: off.
    peer_heartbeat_s: float = 10.0
    peer_timeout_s: float = 30.0
    curve: CurveConfig = field(default_factory=CurveConfig)
    # HOST:PORT of the Prometheus endpoint (/metrics, /healthz, /readyz); a bare PORT
    # listens on 127.0.0.1; "": none (docs/operations.md).
    metrics: str = ""

    def __post_init__(self) -> None:
        problems = out_of_range(self, {"default_timeout_s": (0.001, 3600)})
        problems += listen_problems(self.metrics)
        if self.max_queued < 1:
            problems.append("max_queued must be >= 1")
        problems += out_of_range(
            self,
            {
                "max_queued_mib": (1, 1 << 24),
                "max_client_requests": (1, 1 << 24),
                "max_client_mib": (1, 1 << 24),
                "max_models_per_worker": (1, 256),
                "max_workers": (1, 1 << 16),
                "forget_unserved_s": (0.001, 86_400),
                "liveness": (1, 100),
                "max_attempts": (1, 10),
                "register_grace_s": (0, 600),
                "stop_grace_s": (0, 600),
                "stop_quiet_s": (0, 60),
                "stop_drain_s": (0, 600),
                "watchdog_factor": (1, 1000),
                "watchdog_slack_s": (0.001, 3600),
            },
        )
        if not (self.peer_heartbeat_s == 0 or 0.001 <= self.peer_heartbeat_s <= 3600):
            problems.append("peer_heartbeat_s must be 0 (off) or in 0.001..3600")
        if self.peer_heartbeat_s and not self.peer_heartbeat_s < self.peer_timeout_s <= 3600:
            problems.append("peer_timeout_s must be above peer_heartbeat_s, at most 3600")
        if not 0 <= self.max_frame_mib <= 1 << 20:
            problems.append("max_frame_mib must be in 0..1048576 (0: no limit)")
        if self.local_backend and not _unix_path(self.local_backend):
            problems.append(f"local_backend must be unix:PATH, got {self.local_backend!r}")
        if self.curve.enabled and any(
            e.startswith("inproc:") for e in (self.frontend, self.backend)
        ):
            problems.append("curve.enabled needs tcp:// or ipc:// endpoints (inproc has no CURVE)")
        given: dict[str, object] = dict(self.models)  # (checked: callers pass anything)
        if any(isinstance(b, BatchingConfig) for b in given.values()):
            # A whole BatchingConfig (what this field held before): every key set.
            given = {
                name: BatchingOverride(**dataclasses.asdict(b))
                if isinstance(b, BatchingConfig)
                else b
                for name, b in given.items()
            }
            object.__setattr__(self, "models", given)
        for name, override in given.items():
            if not isinstance(override, BatchingOverride):
                problems.append(f"models.{name} must be a table of [batching] keys")
                continue
            problems.extend(f"models.{name}.{p}" for p in _batching_problems(override))
        check(problems, "broker")

    def batching_for(self, model: str) -> BatchingConfig:
        """``model``'s batching settings: its ``[models.<name>]`` keys over ``batching``."""
        override = self.models.get(model)
        return self.batching if override is None else override.over(self.batching)


#: The keys only the seed policy reads (its ρ rule).
SEED_ONLY = ("target_rho", "learning_rate", "adapt_interval_s")


def unused_settings(config: BrokerConfig) -> list[str]:
    """The seed policy's keys set where no model's policy is ``seed``, so that they
    change nothing (``batching.target_rho``, ``models.m.learning_rate``, ...): a
    ``[models.<name>]`` key that table sets under another policy, and a ``[batching]``
    key away from its default while neither it nor a table that leaves the key to it
    picks ``seed``."""
    found: list[str] = []
    base, default = config.batching, BatchingConfig()
    for key in SEED_ONLY:
        inherits = [m for m, o in config.models.items() if getattr(o, key) is None]
        read = base.policy == "seed" or any(
            config.batching_for(m).policy == "seed" for m in inherits
        )
        if not read and getattr(base, key) != getattr(default, key):
            found.append(f"batching.{key}")
    for name, override in config.models.items():
        if config.batching_for(name).policy != "seed":
            found += [f"models.{name}.{k}" for k in SEED_ONLY if getattr(override, k) is not None]
    return found


def _unix_path(endpoint: str) -> bool:
    try:
        return link_path(endpoint) is not None
    except ValueError:  # "unix:" with no path
        return False
