"""auth.py: who may connect to the broker's two ROUTERs, and who may say what.

:class:`Door` is the ZAP handler of the broker's context, made before either socket
binds and answered in the broker's own loop, with or without CURVE: every new
connection's handshake on either ROUTER asks it (each has a ZAP domain, :data:`CLIENTS`
or :data:`WORKERS`). With ZAP on, libzmq refuses peers that speak ZMTP 1.0 or 2.0, so the
bytes of a raw TCP peer (a port scanner, a load balancer's health check, an HTTP request
sent to the wrong port) are never taken for an old ZeroMQ peer's messages. Once the
broker is stopping, the door answers every new handshake "300" (try again later: libzmq
holds the connection without a handshake until the ROUTER closes, then the peer connects
again), so a client or worker that connects or reconnects meanwhile reaches the broker
that comes next, while the connections already open stay until the broker closes them.
(A "400" would be final: libzmq's connecting side gives the endpoint up for good.)

In the loop rather than on a thread (pyzmq's ``ThreadAuthenticator``, an asyncio loop of
its own): one thread owns the broker's state, and a handshake does not wait for the GIL
behind the broker's work; bench/handshake.py measured a connect and its first answer
0.3 ms sooner so, idle or busy (docs/security.md, "The door"). Until the server is
closed after its loop ends, nobody answers: the handshakes held then end with it.

With ``[curve] enabled``, both ROUTERs are CURVE servers with the broker's key pair, and
:class:`BrokerAuth` has the door check each connecting key against the allow-list of the
socket's ZAP domain: :data:`CLIENTS` for the frontend (the clients' and the operators'
keys), :data:`WORKERS` for the backend (the workers'). The lists are separate, so a
client key never completes a handshake on the worker socket. A peer without CURVE, or
with a key not on the list, never gets a message to the broker: libzmq ends its
handshake. :meth:`BrokerAuth.reload` reads the directories again (SIGHUP): a removed key
can no longer connect (connections already open stay until they close).

Each message then carries its connection's authenticated key (the ``User-Id`` property,
the Z85 public key). On the frontend the core's client id is that key followed by what
the server keyed the client by before (:meth:`BrokerAuth.client_key`), so every request,
its reply and STATS access (:meth:`BrokerAuth.is_operator`) are bound to the key; the
reply goes to the id after the key (:data:`KEY_CHARS` bytes on). On the backend
:class:`WorkerKeys` records the key a worker id first spoke with and refuses a message
under that id with another key while the worker is registered.

Refused handshakes and messages are logged by a :class:`RateLimitedLog`: at most so many lines
a minute, then one line with the count of those not logged.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils import z85

from carpool.broker.config import CurveConfig
from carpool.common.curve import KEY_CHARS, KeyPair, load_allowed, load_keypair
from carpool.common.errors import ConfigError
from carpool.common.peer_names import peer_tag
from carpool.common.ratelog import RateLimitedLog

__all__ = ["CLIENTS", "KEY_CHARS", "WORKERS", "BrokerAuth", "Door", "WorkerKeys"]

logger = logging.getLogger(__name__)

#: ZAP domains of the frontend and the backend.
CLIENTS, WORKERS = "carpool-clients", "carpool-workers"
_ZAP_ENDPOINT, _ZAP_VERSION = "inproc://zeromq.zap.01", b"1.0"  # RFC 27
_BURST = 256  # ZAP requests answered a loop turn at most
_USER_ID = "User-Id"
_frame_get = zmq.Frame.get


def _frame_bytes(frame: zmq.Frame) -> bytes:
    return frame.bytes


def _user_id(frame: zmq.Frame) -> str:
    """The authenticated key of the connection a message came by (its ``User-Id``)."""
    return _frame_get(frame, _USER_ID)  # type: ignore[return-value]  # (a str property)


class Door:
    """The ZAP handler (RFC 27) of the broker's context, answered in the broker's own loop:
    see the module docstring. Made before either socket binds (it binds the context's ZAP
    endpoint); :meth:`guard` puts a socket behind it; the server polls :attr:`socket` and
    calls :meth:`on_poll`; :meth:`close_to` refuses new handshakes for good.

    Raises:
        ConfigError: another ZAP handler already serves this context.
    """

    def __init__(self, context: zmq.Context[Any]) -> None:
        # libzmq asks as a REQ peer, one per connection: a REP answers each in turn.
        self.socket: zmq.Socket[bytes] = context.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        for wait_s in (0.001, 0.01, 0.1, None):
            try:
                self.socket.bind(_ZAP_ENDPOINT)
                break
            except zmq.ZMQError as exc:
                # A door closed on this context a moment ago frees the endpoint on
                # libzmq's reaper thread: a few tries, then it is another's.
                if wait_s is None or exc.errno != errno.EADDRINUSE:
                    self.socket.close()
                    msg = f"another ZAP handler serves this zmq context: {exc}"
                    raise ConfigError(msg) from None
                threading.Event().wait(wait_s)
        self._closed: frozenset[str] = frozenset()
        self._keys: dict[str, frozenset[bytes]] = {}  # CURVE allow-lists (Z85) by domain
        #: Told of each CURVE key refused (its domain and Z85 key).
        self.on_refused: Callable[[str, bytes], None] = _ignore_refusal
        #: Handshakes refused because the broker is stopping.
        self.refused = 0
        self._stamps: dict[str, Callable[[], bytes]] = {}  # metadata for admitted ones

    @staticmethod
    def guard(sock: zmq.Socket[Any], domain: str) -> None:
        """Have ``sock``'s new connections ask the door (before it binds)."""
        sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())

    def stamp(self, domain: str, metadata: Callable[[], bytes]) -> None:
        """Have each handshake admitted on ``domain`` carry ``metadata()`` (ZAP metadata:
        properties libzmq puts on every message of that connection)."""
        self._stamps[domain] = metadata

    def allow(self, domain: str, keys: frozenset[bytes]) -> None:
        """The CURVE keys (Z85) admitted on ``domain`` from now on."""
        self._keys[domain] = keys

    def close_to(self, *domains: str) -> None:
        """Refuse every new handshake of ``domains`` from now on, "300"."""
        self._closed = self._closed | frozenset(domains)

    def on_poll(self, limit: int = _BURST) -> int:
        """Answer the ZAP requests waiting, ``limit`` at most (a flood of connections
        takes its turn beside the messages); returns how many."""
        sock, n = self.socket, 0
        while n < limit:
            try:
                request = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            sock.send_multipart(self._answer(request))
            n += 1
        return n

    def _answer(self, msg: list[bytes]) -> list[bytes]:
        """A ZAP reply: version, request id, status, text, user id, metadata."""
        rid = msg[1] if len(msg) > 1 else b""
        if len(msg) < 6 or msg[0] != _ZAP_VERSION:
            return [_ZAP_VERSION, rid, b"400", b"malformed ZAP request", b"", b""]
        domain, mechanism = msg[2].decode("utf-8", "replace"), msg[5]
        if domain in self._closed:
            self.refused += 1
            return [_ZAP_VERSION, rid, b"300", b"the broker is stopping", b"", b""]
        stamp = self._stamps.get(domain)
        if mechanism == b"NULL":
            return [_ZAP_VERSION, rid, b"200", b"OK", b"", stamp() if stamp else b""]
        if mechanism == b"CURVE" and len(msg) == 7 and len(msg[6]) == 32:
            key = z85.encode(msg[6])
            if key in self._keys.get(domain, frozenset()):
                return [_ZAP_VERSION, rid, b"200", b"OK", key, stamp() if stamp else b""]
            self.on_refused(domain, key)
            return [_ZAP_VERSION, rid, b"400", b"key not allowed", b"", b""]
        return [_ZAP_VERSION, rid, b"400", b"mechanism not allowed", b"", b""]

    def close(self) -> None:
        self.socket.close(linger=0)


def _ignore_refusal(domain: str, key: bytes) -> None:
    """(A door without CURVE's log.)"""


class BrokerAuth:
    """The broker's key pair, and its allow-lists in the door.

    Args:
        door: the broker's ZAP handler, which admits the keys.
        config: the ``[curve]`` settings (enabled).

    Raises:
        ConfigError: a key file or an allow-list cannot be read, or the secret is not private.
    """

    def __init__(self, door: Door, config: CurveConfig) -> None:
        self.config = config
        self.pair: KeyPair = load_keypair(
            config.server_key, "curve.server_key (--curve-server-key)"
        )
        self.failures = RateLimitedLog(logger, config.failure_logs_per_min)
        self.operators: frozenset[bytes] = frozenset()
        self._door = door
        self._counts = (0, 0)  # client and worker keys
        self._load()  # first: a bad directory is a ConfigError, not a log line
        door.on_refused = self._refused

    def _refused(self, domain: str, key: bytes) -> None:
        side = "client" if domain == CLIENTS else "worker"
        self.failures("CURVE key %s refused on the %s socket", key.decode(), side)

    def _load(self) -> None:
        config = self.config
        clients = load_allowed(config.clients)
        workers = load_allowed(config.workers)
        operators = load_allowed(config.operators) if config.operators else frozenset()
        self._door.allow(CLIENTS, clients | operators)
        self._door.allow(WORKERS, workers)
        self._counts = (len(clients - operators), len(workers))
        self.operators = operators

    def reload(self) -> bool:
        """Read the allow-lists again (SIGHUP); on a problem keep the current ones and log it."""
        try:
            self._load()
        except ConfigError as exc:
            logger.error("CURVE allow-lists not reloaded (the current ones stay): %s", exc)
            return False
        logger.info(
            "CURVE allow-lists reloaded: %d client, %d worker, %d operator keys",
            *self._counts,
            len(self.operators),
        )
        return True

    def secure(self, sock: zmq.Socket[Any], domain: str) -> None:
        """Make ``sock`` a CURVE server of ZAP ``domain`` (before it binds). With
        ``ZAP_ENFORCE_DOMAIN`` it fails closed: with no authenticator answering, libzmq
        refuses every handshake instead of admitting any key."""
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.pair.secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.pair.public)
        sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)

    def secure_frontend(self, sock: zmq.Socket[Any]) -> None:
        self.secure(sock, CLIENTS)

    def secure_backend(self, sock: zmq.Socket[Any]) -> None:
        self.secure(sock, WORKERS)

    @staticmethod
    def client_key(
        inner: Callable[[zmq.Frame], bytes] = _frame_bytes,
    ) -> Callable[[zmq.Frame], bytes]:
        """The core's client id for a frontend message, from its routing-id frame: the
        sender's authenticated key, then ``inner``'s id (by default the routing id)."""

        user_id = _user_id

        def key(first: zmq.Frame) -> bytes:
            return user_id(first).encode() + inner(first)

        return key

    @staticmethod
    def key_of(client: bytes) -> bytes:
        """The authenticated key the core's client id ``client`` starts with
        (:meth:`client_key`): part of a request's origin (intake.py)."""
        return client[:KEY_CHARS]

    def is_operator(self, client: bytes) -> bool:
        """Whether the core's client id ``client`` is an operator's (STATS)."""
        return client[:KEY_CHARS] in self.operators


class WorkerKeys:
    """The key each worker id on the backend first spoke with.

    Args:
        knows: whether the broker has that worker registered now; a binding outlives its
            worker only until the table is next pruned, and a worker id that is no longer
            registered may be taken by another key.
        log: where refusals go.
    """

    def __init__(self, knows: Callable[[bytes], bool], log: RateLimitedLog) -> None:
        self._knows = knows
        self._log = log
        self._by_worker: dict[bytes, str] = {}
        self._prune_at = 64
        self.refused = 0

    def __len__(self) -> int:
        return len(self._by_worker)

    def admit(self, wid: bytes, first: zmq.Frame) -> bool:
        """Whether the message whose routing-id frame is ``first`` may be heard."""
        key = _user_id(first)
        bound = self._by_worker.get(wid)
        if bound == key:
            return True
        if bound is not None and self._knows(wid):
            self.refused += 1
            self._log(
                "worker peer=%s spoke with key %s; it registered with %s: refused",
                peer_tag(wid),
                key,
                bound,
            )
            return False
        self._by_worker[wid] = key
        if len(self._by_worker) > self._prune_at:
            knows = self._knows
            self._by_worker = {w: k for w, k in self._by_worker.items() if knows(w) or w == wid}
            self._prune_at = max(64, 2 * len(self._by_worker))
        return True
