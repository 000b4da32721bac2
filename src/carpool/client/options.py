"""options.py: ClientOptions — what both client twins are configured with, validated once.

Pure: values only, no sockets, files or clock. One value opens either twin:
``Client(endpoint, options=opts)`` and ``AsyncClient(endpoint, options=opts)``. Each
also takes the fields as keyword arguments instead (typed by :class:`ClientOptionArgs`,
so a checker sees each name and type) and builds one :class:`ClientOptions` from them
(:func:`client_options`); the context and clock stay their own arguments, since each
twin takes its own kind of context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypedDict

#: The longest timeout a request may have (protocol: ``timeout_ms`` up to an hour).
MAX_TIMEOUT_S = 3600.0


class ClientOptionArgs(TypedDict, total=False):
    """The keyword arguments of ``Client`` and ``AsyncClient``: :class:`ClientOptions`."""

    default_timeout_s: float
    grace_s: float
    shared_memory: int
    shared_memory_min_bytes: int
    shared_memory_mode: int
    shared_memory_outputs: bool
    shared_memory_group: str | None
    send_timeout_s: float | None
    curve_server_key: str
    curve_key: str


@dataclass(frozen=True, slots=True)
class ClientOptions:
    """How a client sends its requests and waits for their answers.

    Args:
        default_timeout_s: timeout of requests that give none, in (0, 3600].
        grace_s: how long past a request's timeout to wait for the broker's answer before
            raising :class:`~carpool.common.errors.Unavailable` (0 or more).
        shared_memory: bytes of a shared-memory region (``/dev/shm/carpool-*``) for large
            inputs; 0 (the default) sends every input in its frame. Use it only when every
            worker of the models you call runs on this host and can read the region
            (protocol §5.4): a worker that cannot answers that request ``UNAVAILABLE``.
        shared_memory_min_bytes: inputs this large or larger go through the region (while
            it has room; the rest go in their frames).
        shared_memory_mode: the region's file permissions (0o600: only this user's
            workers can read it; 0o640 for workers running as another user in its group).
        shared_memory_outputs: ask workers to hand large outputs (64 KiB and up) over in
            their shared-memory rings (protocol §5.5), which this client copies out when
            the reply arrives. Only for clients on the workers' host that can read their
            rings (``shm_output_mode``/``shm_output_group`` in the worker's config); if a
            ring cannot be opened, that request fails ``Unavailable`` and the client stops
            asking.
        shared_memory_group: the region's group, for workers that run as another user
            in it (with ``shared_memory_mode=0o640``).
        send_timeout_s: how long a request may wait to be sent while the broker takes
            nothing (it is away, and 1,000 messages wait for it already); None: up to
            the request's own timeout; 0: not at all (a load generator must not wait).
            A request not sent in that time fails ``Unavailable``.
        curve_server_key: for a broker with CURVE on (docs/security.md): its public key,
            as Z85 text or the path of its ``.key`` file. "" (the default): no CURVE.
        curve_key: this client's key pair with CURVE: the path of its ``.key_secret``
            file (``carpool keygen``; mode 0600); the key itself as text is refused.
            Both or neither.

    Raises:
        ValueError: an option out of its range (every such option named at once).
    """

    default_timeout_s: float = 10.0
    grace_s: float = 1.0
    shared_memory: int = 0
    shared_memory_min_bytes: int = 64 * 1024
    shared_memory_mode: int = 0o600
    shared_memory_outputs: bool = False
    shared_memory_group: str | None = None
    send_timeout_s: float | None = None
    curve_server_key: str = ""
    curve_key: str = ""

    def __post_init__(self) -> None:
        problems = []
        if not 0 < self.default_timeout_s <= MAX_TIMEOUT_S:
            problems.append(f"default_timeout_s must be in (0, 3600], got {self.default_timeout_s}")
        if not (self.grace_s >= 0 and math.isfinite(self.grace_s)):
            problems.append(f"grace_s must be a finite 0 or more, got {self.grace_s}")
        if self.send_timeout_s is not None and not self.send_timeout_s >= 0:
            problems.append(f"send_timeout_s must be None or 0 or more, got {self.send_timeout_s}")
        if self.shared_memory < 0:
            problems.append(f"shared_memory must be 0 (off) or a size, got {self.shared_memory}")
        if self.shared_memory_min_bytes < 0:
            problems.append(
                f"shared_memory_min_bytes must be 0 or more, got {self.shared_memory_min_bytes}"
            )
        if bool(self.curve_server_key) != bool(self.curve_key):
            problems.append("curve_server_key and curve_key go together (CURVE needs both)")
        if problems:
            raise ValueError("; ".join(problems))


def client_options(options: ClientOptions | None, args: ClientOptionArgs) -> ClientOptions:
    """The options a twin opens with: ``options`` as given, or one built from the keyword
    arguments ``args``.

    Raises:
        TypeError: both were given.
        ValueError: an option out of its range.
    """
    if options is None:
        return ClientOptions(**args)
    if args:
        raise TypeError(f"options= or keyword options, not both (got {', '.join(sorted(args))})")
    return options
