"""from_client.py: what a client says to the broker, one typed union decoded in one place — pure.

:func:`decode_from_client` turns a client's message (its frames after the routing id)
into one of :data:`FromClient`: a :class:`Request` (framed or in the simple form), a
:class:`~carpool.common.protocol.client_messages.Cancel`, a :class:`StatsQuery`, a
:class:`~carpool.common.protocol.metadata.MetadataRequest`, or a :class:`ClientMalformed`
that carries what its error reply needs. It never raises on bad input. A REQ socket's
empty delimiter frame is read here (``delimited``: the answer goes back after one too).

REQUEST has one validator, :func:`decode_request`: every rule of a REQUEST meta lives
there. A broker sees the same few request layouts (model, input names, dtypes, shapes)
again and again; its :class:`KnownLayouts` remembers the ones that passed its own checks
against the model, with a value of its own (the broker's queue key and sample count).
A request of a remembered layout, whose frames are as long as they were, decodes with
its inputs taken from the cache and that value as :attr:`Request.layout`; any other has
``layout`` None and is checked against its model by the broker. Either way the decoder
returns the same :class:`Request`, as ``BatchMeta.from_wire(meta, known)`` does. Payload
frames are never read or copied: a framed request's ``payloads`` are the objects that
arrived.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, Generic, TypeVar, cast, overload

from carpool.common.errors import ErrorCode, ProtocolError
from carpool.common.protocol.client_messages import (
    Cancel,
    Submit,
    client_nonce_of,
    request_id_of,
)
from carpool.common.protocol.frames import (
    MAX_NAME_CHARS,
    MAX_SIMPLE_BYTES,
    MAX_TIMEOUT_MS,
    PRIORITIES,
    PROTOCOL_VERSION,
    Command,
    Frame,
    Priority,
    Signature,
    TensorMeta,
    VersionMismatch,
    check_frame_sizes,
    decode_meta,
    encode,
    header,
    is_simple_form,
    parse_header,
    require_map,
    require_name,
    tensor_list,
    tensor_signature,
    unpack,
    view,
)
from carpool.common.protocol.metadata import MetadataRequest
from carpool.common.protocol.refs import MAX_REF_BYTES, ShmRef, shm_refs

L = TypeVar("L")

#: :func:`~carpool.common.protocol.frames.view` as the type itself, and ``bytes`` typed for
#: a frame (a header's lookup).
# speed: docs/benchmarks.md "Why the hot path looks as it does"
_view = cast(Callable[[Frame], memoryview], memoryview)
_bytes = cast(Callable[[Frame], bytes], bytes)
#: The commands a client sends, as globals.
# speed: docs/benchmarks.md "Why the hot path looks as it does"
_REQUEST, _CANCEL, _STATS, _METADATA = (
    Command.REQUEST,
    Command.CANCEL,
    Command.STATS,
    Command.METADATA,
)
#: The one type of a shape's dims that matches a remembered layout (a bool or a float
#: hashes like the int it equals).
_INT = frozenset((int,))
#: A tensor descriptor's (name, dtype, shape): its part of a layout's signature.
_SIGNATURE = itemgetter("name", "dtype", "shape")
#: The header frames of the commands a client sends, to their command: one lookup.
_HEADERS = {header(c): c for c in (_REQUEST, _CANCEL, _STATS, _METADATA)}


@dataclass(slots=True, eq=False)
class Request(Generic[L]):
    """A REQUEST that passed :func:`decode_request` (framed, or the simple form). Not
    frozen, for speed: docs/benchmarks.md "Why the hot path looks as it does"."""

    request_id: int
    model: str
    # Relative budget from the broker's receipt; None: the broker's default.
    timeout_ms: int | None
    priority: Priority
    inputs: tuple[TensorMeta, ...]  # in the request's order
    # Per input, in the request's order: its shared-memory reference or None (§5.4);
    # None when every input is in its frame.
    shm: tuple[ShmRef | None, ...] | None
    shm_outputs: bool  # the client reads outputs from a worker's ring (§5.5)
    nonce: bytes | None  # the client's nonce (REQUEST ``client``, §6.1)
    payloads: Sequence[Frame]  # one per input, in the request's order
    nbytes: int  # the payload frames' bytes (an input in shared memory: none)
    delimited: bool = False  # it came after an empty delimiter frame (a REQ socket)
    simple: bool = False  # it came in the simple form (answered in it)
    # A layout remembered in :class:`KnownLayouts` (its value), which this request has,
    # frames included; None: the broker checks it against its model.
    layout: L | None = None


@dataclass(frozen=True, slots=True)
class StatsQuery:
    """STATS (§6.4): the broker's counters, asked; ``request_id`` is echoed."""

    request_id: int | None = None
    delimited: bool = False

    def to_frames(self) -> list[Any]:
        """The STATS request's frames (its one encoder)."""
        return encode(Command.STATS, {} if self.request_id is None else {"id": self.request_id})


@dataclass(frozen=True, slots=True)
class ClientMalformed:
    """A client message that breaks the protocol, with what its ERROR needs: the request
    id when it could be read, the code (INVALID_ARGUMENT, or UNSUPPORTED_VERSION) and the
    message; ``version``: the protocol version a framed header named, when that was the
    fault (the broker logs it)."""

    request_id: int | None
    code: ErrorCode
    message: str
    delimited: bool = False
    simple: bool = False
    version: int | None = None


#: What the broker receives from a client.
FromClient = Request[L] | Cancel | StatsQuery | MetadataRequest | ClientMalformed


class KnownLayouts(Generic[L]):
    """Request layouts the broker checked against their model, each with its value; up
    to ``max_layouts`` (all forgotten at once when full: clients choose shapes)."""

    def __init__(self, max_layouts: int = 1024) -> None:
        self.max_layouts = max_layouts
        # (model, signature) -> (the inputs, each payload frame's length, the value)
        self.layouts: dict[
            tuple[str, Signature], tuple[tuple[TensorMeta, ...], tuple[int, ...], L]
        ] = {}

    def remember(self, request: Request[L], value: L) -> None:
        """Remember the layout of ``request`` (framed, checked by the broker) with ``value``."""
        if len(self.layouts) >= self.max_layouts:
            self.layouts.clear()
        inputs = request.inputs
        key = (request.model, tuple((t.name, t.dtype, t.shape) for t in inputs))
        self.layouts[key] = (inputs, tuple(t.nbytes for t in inputs), value)

    def forget_model(self, model: str) -> None:
        """Forget the layouts of ``model`` (its spec changed, or it is forgotten)."""
        for key in [key for key in self.layouts if key[0] == model]:
            del self.layouts[key]


@overload
def decode_request(meta: dict[str, Any], payloads: Sequence[Frame] = ()) -> Request[Any]: ...
@overload
def decode_request(
    meta: dict[str, Any],
    payloads: Sequence[Frame],
    known: KnownLayouts[L] | None,
    *,
    delimited: bool = False,
) -> Request[L]: ...


def decode_request(
    meta: dict[str, Any],
    payloads: Sequence[Frame] = (),
    known: KnownLayouts[L] | None = None,
    *,
    delimited: bool = False,
) -> Request[L]:
    """A REQUEST meta (or the map of a simple-form request) checked, with its payload
    frames; ``known``: the layouts a broker remembers (then ``layout`` is the value of
    the request's, if it has one, frames included). Its arrays may be lists or tuples;
    a layout's signature is built in C from tuples (as :func:`decode_from_client`
    unpacks a REQUEST's meta), in Python from lists.

    Raises:
        ProtocolError: the meta breaks a rule (its message names which).
    """
    # Per request: each rule's usual case is checked inline, and its own function runs
    # (and raises, with its message) only where that fails.
    rid = meta.get("id")
    if type(rid) is not int or not 0 <= rid < 1 << 64:
        rid = request_id_of(meta)  # (an int of another type, a bool: None)
        if rid is None:
            raise ProtocolError("request: field 'id' missing or not an unsigned 64-bit int")
    model = meta.get("model")
    if type(model) is not str or not model or len(model) > MAX_NAME_CHARS:
        model = require_name(model, "request model")
    timeout = meta.get("timeout_ms")
    if timeout is not None and (type(timeout) is not int or not 0 < timeout <= MAX_TIMEOUT_MS):
        raise ProtocolError(f"request: timeout_ms must be an int in 1..{MAX_TIMEOUT_MS}")
    prio = meta.get("priority", 0)
    if type(prio) is not int or prio not in (0, 1):
        raise ProtocolError("request: priority must be 0 (interactive) or 1 (bulk)")
    raw: Any = meta.get("inputs")
    entry = None
    if known is not None and known.layouts:
        # speed: docs/benchmarks.md "Why the hot path looks as it does"
        try:  # (a meta unpacked with tuples: the signature built in C)
            sig = (_SIGNATURE(raw[0]),) if len(raw) == 1 else tuple(map(_SIGNATURE, raw))
            entry = known.layouts.get((model, sig))
        except (KeyError, TypeError):  # not maps with the three keys, or lists (unhashable)
            signature = tensor_signature(raw)
            if signature is not None:
                entry = known.layouts.get((model, signature))
    shm = False  # an input is in shared memory
    if entry is not None:
        # A remembered layout's descriptors passed tensor_list when it was remembered; a
        # bool or a float dim hashes and compares as the int it equals: refused here.
        for t in raw:
            for d in t["shape"]:
                if type(d) is not int:
                    entry = None
            if "shm" in t:
                shm = True
    if entry is None:
        inputs = tensor_list(raw, "request inputs")
        shm = False
        for t in raw:  # (maps: tensor_list checked them)
            if "shm" in t:
                shm = True
                break
    else:
        inputs = entry[0]
    shm_outputs = meta.get("shm_outputs", False)
    if type(shm_outputs) is not bool:
        raise ProtocolError("request: shm_outputs must be true or false")
    nonce = meta.get("client")
    if nonce is not None:
        nonce = client_nonce_of(meta, "request")
    refs = shm_refs(raw) if shm else None
    layout = None
    if entry is None or refs is not None:
        lengths = tuple(map(len, payloads))
        nbytes = sum(lengths)
        if entry is not None and refs is not None and _fit(entry[1], lengths, refs):
            layout = entry[2]
    else:  # (each frame as long as the layout's: its value)
        sizes = entry[1]
        fits = len(payloads) == len(sizes)
        nbytes = i = 0
        for frame in payloads:  # (a counter, not zip or enumerate: no iterator built)
            length = len(frame)
            nbytes += length
            if fits and length != sizes[i]:
                fits = False
            i += 1  # noqa: SIM113
        if fits:
            layout = entry[2]
    return Request(
        rid,
        model,
        timeout,
        PRIORITIES[prio],
        inputs,
        refs,
        shm_outputs,
        nonce,
        payloads,
        nbytes,
        delimited,
        False,
        layout,
    )


def _fit(sizes: tuple[int, ...], lengths: tuple[int, ...], refs: tuple[ShmRef | None, ...]) -> bool:
    """Whether frames of ``lengths`` fit a remembered layout's ``sizes`` where some inputs
    are in shared memory (``refs``): each of those has an empty frame, of a size the
    frame checks allow."""
    if len(lengths) != len(sizes):
        return False
    for length, size, ref in zip(lengths, sizes, refs, strict=True):
        if length != (size if ref is None else 0) or size > MAX_REF_BYTES:
            return False
    return True


def decode_simple(frame: Frame, *, delimited: bool = False) -> Request[Any]:
    """A single-frame simple-form request, checked (§7). Its inline ``data`` fields are
    copied out of msgpack: the form is meant for small tensors from small devices.

    Raises:
        ProtocolError: as :func:`decode_request`, or a rule of the simple form (its
            ``meta``: the decoded map, when there was one).
    """
    obj = require_map(unpack(view(frame), max_bytes=MAX_SIMPLE_BYTES), "simple request")
    try:
        version = obj.get("v")
        if type(version) is not int:
            raise ProtocolError("simple request: field 'v' (protocol version) missing")
        if version != PROTOCOL_VERSION:
            raise VersionMismatch(version)
        request: Request[Any] = decode_request(obj, (), None, delimited=delimited)
        if request.shm is not None or request.shm_outputs:
            raise ProtocolError("simple request: shared memory needs the framed form")
        if request.nonce is not None:
            raise ProtocolError("simple request: client (resends, CANCEL) needs the framed form")
        payloads: list[bytes] = []
        for raw, t in zip(obj["inputs"], request.inputs, strict=True):
            data = raw.get("data")
            if not isinstance(data, bytes):
                raise ProtocolError(f"simple request: tensor {t.name!r} has no bin 'data' field")
            payloads.append(data)
        check_frame_sizes(request.inputs, payloads)
    except ProtocolError as exc:
        exc.meta = obj
        raise
    request.payloads = payloads
    request.nbytes = sum(len(data) for data in payloads)
    request.simple = True
    return request


def decode_submit(meta: dict[str, Any]) -> Submit:
    """A REQUEST meta checked by :func:`decode_request`, as the :class:`Submit` a client
    sends (what a client's frames say, read back)."""
    return _submit(decode_request(meta))


def decode_simple_request(frame: Frame) -> tuple[Submit, list[bytes]]:
    """A simple-form request checked by :func:`decode_simple`, as a :class:`Submit` and
    its payloads."""
    request = decode_simple(frame)
    return _submit(request), list(request.payloads)  # type: ignore[arg-type]


def _submit(r: Request[Any]) -> Submit:
    return Submit(
        r.request_id, r.model, r.timeout_ms, r.inputs, r.priority, r.shm, r.shm_outputs, r.nonce
    )


@overload
def decode_from_client(frames: Sequence[Frame]) -> FromClient[Any]: ...
@overload
def decode_from_client(frames: Sequence[Frame], known: KnownLayouts[L]) -> FromClient[L]: ...


def decode_from_client(
    frames: Sequence[Frame], known: KnownLayouts[L] | None = None
) -> FromClient[L]:
    """The typed message of a client's frames (after the routing id, as a socket gives
    them); ``known``: the broker's remembered layouts. Never raises: a message that
    breaks the protocol is a :class:`ClientMalformed`."""
    count = len(frames)
    # A DEALER's REQUEST first, as the rest would decode it.
    # speed: docs/benchmarks.md "Why the hot path looks as it does"
    if count > 1 and _HEADERS.get(_bytes(frames[0])) is _REQUEST:
        meta: dict[str, Any] | None = None
        try:
            meta = decode_meta(frames[1], False)  # (arrays as tuples: see decode_request)
            return decode_request(meta, frames[2:], known)
        except ProtocolError as exc:
            return ClientMalformed(request_id_of(meta), ErrorCode.INVALID_ARGUMENT, str(exc))
    delimited = count > 1 and not len(frames[0])
    if delimited:
        frames = frames[1:]
        count -= 1
    if count == 1 and is_simple_form(view(frames[0])):
        try:
            return decode_simple(frames[0], delimited=delimited)
        except ProtocolError as exc:
            code = _code_of(exc)
            return ClientMalformed(request_id_of(exc.meta), code, str(exc), delimited, True)
    meta = None
    try:
        if not count:
            raise ProtocolError("empty message")
        # speed: docs/benchmarks.md "Why the hot path looks as it does"
        command = _HEADERS.get(_bytes(frames[0]))  # (a v1 header of a client's command)
        if command is None:
            command = parse_header(_view(frames[0]))
        if command is _REQUEST:
            if count < 2:
                raise ProtocolError("REQUEST needs a meta frame")
            # (arrays as tuples: an input's signature is hashable as it arrives)
            meta = decode_meta(frames[1], False)
            return decode_request(meta, frames[2:], known, delimited=delimited)
        if command is _CANCEL:
            if count != 2:
                raise ProtocolError("CANCEL is a header and a meta frame")
            meta = decode_meta(view(frames[1]))
            return Cancel.from_wire(meta)
        if command is _STATS:
            if count == 1:
                return StatsQuery(None, delimited)
            return StatsQuery(request_id_of(decode_meta(view(frames[1]))), delimited)
        if command is _METADATA:
            if count == 1:
                return MetadataRequest(delimited=delimited)
            query = MetadataRequest.from_wire(decode_meta(view(frames[1])))
            return MetadataRequest(query.request_id, query.model, delimited)
        raise ProtocolError(f"command {command.name} is not valid from a client")
    except VersionMismatch as exc:
        return ClientMalformed(None, _code_of(exc), str(exc), delimited, version=exc.version)
    except ProtocolError as exc:
        return ClientMalformed(request_id_of(meta), ErrorCode.INVALID_ARGUMENT, str(exc), delimited)


def _code_of(exc: ProtocolError) -> ErrorCode:
    if isinstance(exc, VersionMismatch):
        return ErrorCode.UNSUPPORTED_VERSION
    return ErrorCode.INVALID_ARGUMENT
