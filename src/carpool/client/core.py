"""core.py: ClientCore — what both clients share: ids, encoding, decoding, local deadlines.

Pure: no sockets, threads or clock (``now`` is passed in). The blocking and asyncio
clients are thin shells over it that only move frames, so neither duplicates protocol
logic, the matching of STATS replies to the calls that asked, or send deadlines.

Local deadline: a client that hears nothing for ``timeout + grace`` (the broker answers
every request by its deadline) fails the request :class:`Unavailable`.

Sending again, cancelling, connections belong to its
:class:`~carpool.client.resend.Resender` (``ClientCore.resend``), told of each event; the
twins send what it has for the socket (:meth:`ClientCore.outgoing`), and read two sockets
at most: the current one and the one *retiring* after a stopping broker's ``retry``
(:attr:`ClientCore.leaving`: open a new socket, then :meth:`ClientCore.switched`;
:attr:`ClientCore.retiring`: False once nothing waits on the old one, which then closes).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from carpool.client.inputs import Encoded, encode_inputs
from carpool.client.queries import Queries
from carpool.client.resend import Resender
from carpool.client.results import InferResult
from carpool.common.errors import (
    InternalError,
    ProtocolError,
    RequestError,
    Unavailable,
    error_for_code,
)
from carpool.common.protocol import (
    Command,
    ErrorReply,
    Frame,
    Priority,
    ReplyMeta,
    Signature,
    check_frame_sizes,
    decode_meta,
    numpy_dtype,
    parse_header,
    request_frames,
    request_id_of,
    request_wire,
    tensor_signature,
    view,
)
from carpool.common.shm import RegionReader, ShmArena, ShmError

if TYPE_CHECKING:
    from carpool.client.options import ClientOptions

logger = logging.getLogger(__name__)

#: A request settled by the core itself, and its answer.
Failed = tuple[int, RequestError]

# Enum members as globals, for speed: docs/benchmarks.md "Why the hot path looks as it does".
_ERROR, _REPLY = Command.ERROR, Command.REPLY
_QUERIES = (Command.STATS, Command.METADATA)
#: Reply layouts a client remembers (the cache stops growing when full).
_MAX_LAYOUTS = 256


@dataclass(slots=True)
class ClientCore:
    """Request ids, local deadlines and the wire format for one client connection."""

    default_timeout_s: float = 10.0
    grace_s: float = 1.0
    send_timeout_s: float | None = None  # the longest a send may wait; None: its timeout
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _deadlines: list[tuple[float, int]] = field(default_factory=list)
    pending: dict[int, float] = field(default_factory=dict)  # id -> local deadline
    # Reply output layouts validated once: (name, dtype, shape)s -> (name, dtype, shape, bytes)s.
    _layouts: dict[Signature, tuple[tuple[str, np.dtype[Any], tuple[int, ...], int], ...]] = field(
        default_factory=dict
    )
    # Shared-memory inputs (§5.4) of shm_min_bytes or more, held until the request settles.
    arena: ShmArena | None = None
    shm_min_bytes: int = 64 * 1024
    _leases: dict[int, list[int]] = field(default_factory=dict)  # id -> arena offsets
    # Ask workers to put large outputs in their rings (§5.5); read them with `reader`.
    shm_outputs: bool = False
    reader: RegionReader | None = None
    _next_sweep_s: float = 0.0
    #: Connections that closed (current or retiring), and replies for a request no
    #: longer pending (failed, timed out or answered already: dropped), counted.
    lost_connections: int = 0
    late_replies: int = 0
    # STATS and METADATA requests asked and awaited (ids from the same count as requests').
    queries: Queries = field(init=False)
    # What each pending request needs to be sent again, and the client's nonce.
    resend: Resender = field(default_factory=Resender)

    def __post_init__(self) -> None:
        self.queries = Queries(self._ids)

    @classmethod
    def from_options(cls, options: ClientOptions, arena: ShmArena | None = None) -> ClientCore:
        """The core of a client with these options; ``arena``: its shared-memory region."""
        return cls(
            default_timeout_s=options.default_timeout_s,
            grace_s=options.grace_s,
            send_timeout_s=options.send_timeout_s,
            arena=arena,
            shm_min_bytes=options.shared_memory_min_bytes,
            shm_outputs=options.shared_memory_outputs,
        )

    @property
    def resends(self) -> int:
        """Requests sent again (after a lost connection, or an UNAVAILABLE with retry)."""
        return self.resend.resends

    @property
    def switches(self) -> int:
        """Connections left for a new socket after an UNAVAILABLE with retry."""
        return self.resend.switches

    @property
    def leaving(self) -> bool:
        """A ``retry`` refusal on the current connection: open a new socket, keep the old
        one for reading, and call :meth:`switched` before sending anything more."""
        return self.resend.leaving

    @property
    def retiring(self) -> bool:
        """Answers are awaited on the connection left last (False: the twin closes it)."""
        return self.resend.retiring is not None

    def send_window_s(self, timeout_s: float | None) -> float:
        """How long a request with this timeout (None: the default) may wait for room to
        be sent (then it fails ``Unavailable``): its timeout, or ``send_timeout_s``."""
        window_s = self.default_timeout_s if timeout_s is None else timeout_s
        if self.send_timeout_s is not None:
            window_s = min(window_s, self.send_timeout_s)
        return window_s

    def request(
        self,
        now: float,
        model: str,
        inputs: Mapping[str, ArrayLike],
        timeout_s: float | None = None,
        priority: Priority = Priority.INTERACTIVE,
    ) -> tuple[int, list[Any]]:
        """Encode a request (:meth:`encode`) and keep it (:meth:`keep`): its id and frames."""
        encoded = self.encode(now, model, inputs, timeout_s, priority)
        return encoded.rid, self.keep(encoded)

    def encode(
        self,
        now: float,
        model: str,
        inputs: Mapping[str, ArrayLike],
        timeout_s: float | None = None,
        priority: Priority = Priority.INTERACTIVE,
    ) -> Encoded:
        """A request made at ``now``, encoded, with its id; nothing kept. Without shared
        memory (``arena`` None) any thread may call it: it reads settings only, and draws
        the id from a count whose ``next()`` is atomic."""
        timeout = self.default_timeout_s if timeout_s is None else timeout_s
        if not 0 < timeout <= 3600:
            raise ValueError(f"timeout_s must be in (0, 3600], got {timeout}")
        metas, payloads, leases = encode_inputs(inputs, self.arena, self.shm_min_bytes)
        rid = next(self._ids)
        timeout_ms = max(1, round(timeout * 1000))
        nonce = self.resend.nonce
        meta = request_wire(rid, model, metas, timeout_ms, priority, self.shm_outputs, nonce)
        return Encoded(rid, model, meta, payloads, leases, now, timeout)

    def keep(self, encoded: Encoded) -> list[Any]:
        """Keep an encoded request until its answer, from its local deadline; its frames."""
        rid, meta, payloads, now = encoded.rid, encoded.meta, encoded.payloads, encoded.now
        if encoded.leases:
            self._leases[rid] = encoded.leases
        self.resend.keep(rid, encoded.model, meta, payloads, now)
        deadline = now + encoded.timeout_s + self.grace_s
        self.pending[rid] = deadline
        heap = self._deadlines
        heapq.heappush(heap, (deadline, rid))
        if len(heap) > 2 * len(self.pending) + 64:
            # (Answered requests leave their entries until they reach the top: compact.)
            heap[:] = [entry for entry in heap if entry[1] in self.pending]
            heapq.heapify(heap)
        return request_frames(meta, payloads)

    def on_reply(
        self, frames: Sequence[Frame], now: float | None = None
    ) -> tuple[int | None, InferResult | RequestError | dict[str, Any]]:
        """Decode a message from the broker that arrived at ``now`` (a model's latency is
        learnt from it, and a ``retry`` refusal is sent again only while its budget allows;
        None: neither is checked here).

        Returns:
            (request id, result or error) for a request still pending; (query id, meta
            map) for a STATS or METADATA answer awaited (:class:`Queries`), (None, meta
            map) for one that is not; (None, error) for an error that names no pending
            request, or for one kept to be sent again on the next connection.
        Raises:
            ProtocolError: the message is not valid.
        """
        if len(frames) < 2:
            raise ProtocolError("broker replies have a header and a meta frame")
        command = parse_header(view(frames[0]))
        meta = decode_meta(view(frames[1]))
        try:
            return self._decode(command, meta, frames, now)
        except Exception as exc:
            # Whatever a message from the network makes the decoding raise (numpy's own
            # refusals included) is a message that cannot be read, never a client that
            # stops: the callers' read loops go on past a ProtocolError.
            if not isinstance(exc, ProtocolError):
                logger.warning("a message from the broker could not be read", exc_info=True)
            # An answer that names a request waiting here still answers it: with the
            # reason, now, rather than dropped (and the request failed at its timeout).
            rid = request_id_of(meta)
            if command in _QUERIES or rid is None or rid not in self.pending:
                if isinstance(exc, ProtocolError):
                    raise
                raise ProtocolError(f"unreadable message from the broker: {exc!r}") from exc
            msg = f"the broker's answer could not be read: {exc}"
            return self._settle(rid), InternalError(msg, request_id=rid)

    def _decode(
        self, command: Command, meta: dict[str, Any], frames: Sequence[Frame], now: float | None
    ) -> tuple[int | None, InferResult | RequestError | dict[str, Any]]:
        if command in _QUERIES:
            return self.queries.on_answer(meta)
        if command is _ERROR:
            err = ErrorReply.from_wire(meta)
            retry = None if err.retry_after_ms is None else err.retry_after_ms / 1000.0
            exc = error_for_code(
                err.code, err.message, request_id=err.request_id, retry_after_s=retry
            )
            if self.queries.refused(err.request_id, exc):
                return err.request_id, exc  # a STATS or METADATA request refused
            if err.retry and err.request_id in self.pending:
                answer = self.resend.refused(err.request_id, exc, now)
                if answer is None:
                    return None, exc  # sent again on the next connection, or failed later
                return self._settle(err.request_id), answer
            return self._settle(err.request_id, answered=True), exc
        if command is not _REPLY:
            raise ProtocolError(f"unexpected command {command.name} from the broker")
        payloads = frames[2:]
        known = self._known_reply(meta, payloads, now)
        if known is not None:
            return known
        reply = ReplyMeta.from_wire(meta)
        check_frame_sizes(reply.outputs, payloads, reply.shm)
        if reply.shm is not None:
            rid = self._settle(reply.request_id, now, answered=True)
            if rid is None:  # late or unknown: nobody waits, nothing to copy out
                return None, Unavailable("a late reply", request_id=reply.request_id)
            return rid, self._shared_outputs(reply, payloads)
        outputs = {
            t.name: np.frombuffer(view(p), numpy_dtype(t.dtype)).reshape(t.shape)
            for t, p in zip(reply.outputs, payloads, strict=True)
        }
        if len(self._layouts) < _MAX_LAYOUTS:
            sig = tuple((t.name, t.dtype, t.shape) for t in reply.outputs)
            self._layouts[sig] = tuple(
                (t.name, numpy_dtype(t.dtype), t.shape, t.nbytes) for t in reply.outputs
            )
        result = InferResult(outputs, reply.batch_size, reply.queue_ms, reply.compute_ms)
        return self._settle(reply.request_id, now, answered=True), result

    def _shared_outputs(
        self, reply: ReplyMeta, payloads: Sequence[Frame]
    ) -> InferResult | RequestError:
        """A reply whose large outputs are in a worker's ring (§5.5): copied out now,
        before the ring comes round; an output that cannot be read fails the request."""
        assert reply.shm is not None
        outputs: dict[str, NDArray[Any]] = {}
        for t, ref, payload in zip(reply.outputs, reply.shm, payloads, strict=True):
            if ref is None:
                outputs[t.name] = np.frombuffer(view(payload), numpy_dtype(t.dtype)).reshape(
                    t.shape
                )
                continue
            if self.reader is None:
                self.reader = RegionReader(max_open=8)
            try:
                arr = np.empty(t.shape, numpy_dtype(t.dtype))
                self.reader.read_output(ref, memoryview(arr.reshape(-1).view(np.uint8)))  # type: ignore[arg-type]
            except Exception as exc:  # the request is settled: it must get an answer
                if isinstance(exc, ShmError) and exc.unreachable and self.shm_outputs:
                    # This client cannot open the workers' rings (permissions, another
                    # host): stop asking, so later requests get their outputs in frames.
                    self.shm_outputs = False
                    logger.warning(
                        "cannot read a worker's shared-memory ring (%s); asking for "
                        "outputs in frames from now on",
                        exc,
                    )
                msg = f"output {t.name!r} could not be read from shared memory: {exc}"
                return Unavailable(msg, request_id=reply.request_id)
            outputs[t.name] = arr
        return InferResult(outputs, reply.batch_size, reply.queue_ms, reply.compute_ms)

    def _known_reply(
        self, meta: dict[str, Any], payloads: Sequence[Frame], now: float | None
    ) -> tuple[int | None, InferResult] | None:
        """A REPLY whose outputs (names, dtypes, shapes) were validated before, decoded
        without building the metas again; None: anything else (the full path decides)."""
        sig = tensor_signature(meta.get("outputs"))
        layout = None if sig is None else self._layouts.get(sig)
        if layout is None or len(payloads) != len(layout):
            return None
        rid = request_id_of(meta)
        batch_size = meta.get("batch_size", 0)
        queue_ms = meta.get("queue_ms", 0.0)
        compute_ms = meta.get("compute_ms", 0.0)
        if (
            rid is None
            or type(batch_size) is not int
            or type(queue_ms) is not float
            or type(compute_ms) is not float
            or not math.isfinite(queue_ms + compute_ms)
        ):
            return None
        outputs = {}
        for (name, dtype, shape, nbytes), payload in zip(layout, payloads, strict=True):
            if len(payload) != nbytes:
                return None
            outputs[name] = np.frombuffer(view(payload), dtype).reshape(shape)
        result = InferResult(outputs, batch_size, queue_ms, compute_ms)
        return self._settle(rid, now, answered=True), result

    def _settle(
        self, request_id: int | None, answered_s: float | None = None, *, answered: bool = False
    ) -> int | None:
        """Settle a pending request; ``answered_s``: when its outputs came (a latency
        sample); ``answered``: the broker answered it (with outputs, or an error other
        than a ``retry`` refusal). Returns its id, or None for one not pending (late,
        unknown)."""
        if request_id is None:
            return None  # anonymous: nobody waits for it
        if self.pending.pop(request_id, None) is None:
            self.late_replies += 1  # late or duplicate: nobody waits for it any more
            return None
        self.resend.pop(request_id, answered_s, answered=answered)
        if self._leases:
            self._release(request_id)
        return request_id

    def _release(self, request_id: int) -> None:
        """Free a settled request's shared memory. A worker may still read it if the
        broker answered first (a deadline): that batch's result is discarded."""
        offsets = self._leases.pop(request_id, None)
        if offsets is not None and self.arena is not None:
            for offset in offsets:
                self.arena.free(offset)

    def forget(self, request_id: int) -> None:
        """Stop waiting for request ``request_id`` (failed or given up by the caller)."""
        self.pending.pop(request_id, None)
        self.resend.pop(request_id)
        self._release(request_id)

    def connection_lost(self, now: float) -> list[Failed]:
        """The current connection closed, and the twin opened its socket afresh: each
        request pending on it is queued to be sent again (:meth:`outgoing`) while its
        budget allows; the others are returned with their answers (settled here)."""
        self.lost_connections += 1
        return self._settled_all(self.resend.lost(now))

    def switched(self, now: float) -> list[Failed]:
        """The twin left the current connection (:attr:`leaving`) for a new socket, keeping
        the old one for reading (closing one that retired before). Requests refused with
        ``retry``, and those on a retiring socket just closed, are queued for the new one;
        those with too little budget left are returned with their answers (settled)."""
        return self._settled_all(self.resend.switched(now))

    def retiring_lost(self, now: float) -> list[Failed]:
        """The retiring connection closed before every request on it was answered: those
        are queued for the current socket while their budgets allow, the others returned
        with their answers (settled here). (Nothing, uncounted, if nothing waited.)"""
        if self.resend.retiring is None:
            return []
        self.lost_connections += 1
        return self._settled_all(self.resend.retiring_lost(now))

    def cancel(self, request_id: int) -> RequestError | None:
        """Cancel pending request ``request_id``: its CANCEL is queued (:meth:`outgoing`;
        none on a retiring connection, whose broker answers anyway), or, when it is at no
        broker, its answer is returned now (settled). None for a request not pending."""
        if request_id not in self.pending:
            return None
        error = self.resend.cancel(request_id)
        if error is not None:
            self.forget(request_id)
        return error

    def outgoing(self, now: float) -> list[Any] | None:
        """Frames the core has for the socket now (a request sent again, a CANCEL), or
        None; once the socket takes them, call :meth:`took`. Expire first (:meth:`expire`
        fails what may no longer be sent)."""
        return self.resend.outgoing(now) if self.resend.has_outgoing else None

    def took(self) -> None:
        """The socket took the frames :meth:`outgoing` gave."""
        self.resend.took()

    def _settled_all(self, failed: list[Failed]) -> list[Failed]:
        """Settle requests that :attr:`resend` failed (it let go of them already)."""
        for rid, _ in failed:
            self.pending.pop(rid, None)
            self._release(rid)
        return failed

    def expire(self, now: float) -> list[Failed]:
        """Pending requests whose local deadline passed without any reply, and those
        waiting to be sent again whose budget got too small, with their answers (settled
        here). (Also lets go of removed worker rings, about once a second.)"""
        if self.reader is not None and now >= self._next_sweep_s:
            self._next_sweep_s = now + 1.0
            self.reader.sweep()
        out: list[tuple[int, RequestError]] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, rid = heapq.heappop(self._deadlines)
            if self.pending.pop(rid, None) is not None:
                self._release(rid)
                why = self.resend.expired(rid)
                out.append((rid, why or Unavailable("no reply from the broker", request_id=rid)))
        out += self._settled_all(self.resend.expire(now))
        return out

    def next_deadline(self) -> float | None:
        """When :meth:`expire` next has something to do (None: nothing pending)."""
        while self._deadlines and self._deadlines[0][1] not in self.pending:
            heapq.heappop(self._deadlines)
        deadline = self._deadlines[0][0] if self._deadlines else None
        give_up = self.resend.next_give_up()
        if give_up is not None and (deadline is None or give_up < deadline):
            return give_up
        return deadline
