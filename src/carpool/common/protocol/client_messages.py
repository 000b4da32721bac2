"""client_messages.py: what clients and the broker say to each other — pure.

REQUEST (:class:`Submit`, as a client sends it), REPLY (:class:`ReplyMeta`), ERROR
(:class:`ErrorReply`) and CANCEL (:class:`Cancel`) metas, their encoders and the replies'
decoders, and the single-frame simple form of a request and its reply. What the broker
receives from a client is decoded in :mod:`.from_client` (REQUEST's one validator).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from carpool.common.errors import ErrorCode, ProtocolError
from carpool.common.protocol.frames import (
    PROTOCOL_VERSION,
    Command,
    Priority,
    TensorMeta,
    header,
    optional_number,
    pack,
    tensor_list,
)
from carpool.common.protocol.refs import (
    OutputRef,
    ShmRef,
    output_ref_wire,
    parse_output_ref,
    ref_wire,
)

#: Header frames, built once.
_REQUEST, _REPLY, _ERROR = header(Command.REQUEST), header(Command.REPLY), header(Command.ERROR)
_CANCEL = header(Command.CANCEL)

#: Bytes of a client's nonce (REQUEST and CANCEL ``client``, §6.1).
CLIENT_NONCE_BYTES = 16

_Ref = TypeVar("_Ref")


def _tensors_wire(
    tensors: Sequence[TensorMeta],
    refs: Sequence[_Ref | None] | None,
    ref_wire: Callable[[_Ref], dict[str, Any]],
) -> list[dict[str, Any]]:
    """Tensor descriptors on the wire, each with its shared-memory reference (``shm``)
    where it has one."""
    wire = [t.to_wire() for t in tensors]
    if refs is not None:
        for t, ref in zip(wire, refs, strict=True):
            if ref is not None:
                t["shm"] = ref_wire(ref)
    return wire


@dataclass(frozen=True, slots=True)
class Submit:
    """A client's inference request (REQUEST meta)."""

    request_id: int
    model: str
    # Relative budget from the broker's receipt; None lets the broker apply its default.
    timeout_ms: int | None
    inputs: tuple[TensorMeta, ...]
    priority: Priority = Priority.INTERACTIVE
    # Per input, in `inputs` order: where its bytes are in shared memory (§5.4), or None
    # for an input sent in its frame; None when every input is sent in its frame.
    shm: tuple[ShmRef | None, ...] | None = None
    # The client can read outputs from a worker's ring on its host (§5.5).
    shm_outputs: bool = False
    # The client's 128-bit nonce, drawn once at its start: with it the broker knows a
    # request sent again (same nonce and id) and a CANCEL of it (§6.1, §6.5).
    client: bytes | None = None

    def to_wire(self) -> dict[str, Any]:
        inputs = _tensors_wire(self.inputs, self.shm, ref_wire)
        return request_wire(
            self.request_id,
            self.model,
            inputs,
            self.timeout_ms,
            self.priority,
            self.shm_outputs,
            self.client,
        )


def request_wire(
    request_id: int,
    model: str,
    inputs: list[dict[str, Any]],
    timeout_ms: int | None,
    priority: int = 0,
    shm_outputs: bool = False,
    client: bytes | None = None,
) -> dict[str, Any]:
    """A REQUEST meta from its fields; ``inputs`` are descriptor maps (:func:`tensor_wire`,
    with ``shm`` from :func:`ref_wire` for an input in shared memory); ``client``: the
    client's nonce (:data:`CLIENT_NONCE_BYTES`), if it sends one."""
    meta: dict[str, Any] = {"id": request_id, "model": model, "inputs": inputs}
    if timeout_ms is not None:
        meta["timeout_ms"] = timeout_ms
    if priority:  # Priority.INTERACTIVE (0) is the default, left out
        meta["priority"] = int(priority)
    if shm_outputs:
        meta["shm_outputs"] = True
    if client is not None:
        meta["client"] = client
    return meta


def client_nonce_of(meta: dict[str, Any], what: str) -> bytes | None:
    """The ``client`` field of a REQUEST or CANCEL meta: absent, or bin of exactly
    :data:`CLIENT_NONCE_BYTES` bytes.

    Raises:
        ProtocolError: it is there and is something else.
    """
    nonce = meta.get("client")
    if nonce is None:
        return None
    if type(nonce) is not bytes or len(nonce) != CLIENT_NONCE_BYTES:
        raise ProtocolError(f"{what}: client must be bin of {CLIENT_NONCE_BYTES} bytes")
    return nonce


def request_frames(meta: dict[str, Any], payloads: Sequence[object]) -> list[Any]:
    """Frames of a REQUEST whose meta :func:`request_wire` built."""
    return [_REQUEST, pack(meta), *payloads]


def request_id_of(meta: Any) -> int | None:
    """Best-effort request id of a (possibly invalid) request meta, for error replies."""
    if isinstance(meta, dict):
        rid = meta.get("id")
        if isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid < 2**64:
            return rid
    return None


def encode_request(submit: Submit, payloads: Sequence[object]) -> list[Any]:
    """Frames of a REQUEST (for a DEALER client)."""
    return request_frames(submit.to_wire(), payloads)


def encode_simple_request(submit: Submit, payloads: Sequence[bytes]) -> bytes:
    """The one frame of a simple-form request."""
    meta = submit.to_wire()
    meta["v"] = PROTOCOL_VERSION
    for t, data in zip(meta["inputs"], payloads, strict=True):
        t["data"] = bytes(data)
    return pack(meta)


@dataclass(frozen=True, slots=True)
class ReplyMeta:
    """REPLY meta: the outputs of one request, plus where its time went."""

    request_id: int
    outputs: tuple[TensorMeta, ...]
    batch_size: int = 0
    queue_ms: float = 0.0
    compute_ms: float = 0.0
    # Per output: where its bytes are in a worker's ring (§5.5), or None for an output
    # in its frame; None when all are in frames.
    shm: tuple[OutputRef | None, ...] | None = None

    def to_wire(self) -> dict[str, Any]:
        outputs = _tensors_wire(self.outputs, self.shm, output_ref_wire)
        return reply_wire(self.request_id, outputs, self.batch_size, self.queue_ms, self.compute_ms)

    @classmethod
    def from_wire(cls, meta: dict[str, Any]) -> ReplyMeta:
        rid = request_id_of(meta)
        if rid is None:
            raise ProtocolError("reply: field 'id' missing")
        raw = meta.get("outputs")
        outputs = tensor_list(raw, "reply outputs", allow_empty=True)
        assert isinstance(raw, list)  # _tensor_list checked it
        refs: list[OutputRef | None] | None = None
        for i, t in enumerate(raw):
            obj = t.get("shm")
            if obj is not None:
                if refs is None:
                    refs = [None] * len(raw)
                refs[i] = parse_output_ref(obj, f"reply tensor {t.get('name')!r}")
        batch_size = meta.get("batch_size", 0)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int):
            raise ProtocolError("reply: batch_size must be an int")
        return cls(
            rid,
            outputs,
            batch_size,
            optional_number(meta, "queue_ms"),
            optional_number(meta, "compute_ms"),
            None if refs is None else tuple(refs),
        )


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """ERROR meta: why a request (or an unreadable message) failed."""

    request_id: int | None
    code: ErrorCode
    message: str
    retry_after_ms: int | None = None
    # UNAVAILABLE from a broker that is stopping: the request did not run; it may be sent
    # again, with the same id, on a new connection (§6.3, §11).
    retry: bool = False

    def to_wire(self) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.request_id,
            "code": int(self.code),
            "message": self.message,
        }
        if self.retry_after_ms is not None:
            meta["retry_after_ms"] = self.retry_after_ms
        if self.retry:
            meta["retry"] = True
        return meta

    @classmethod
    def from_wire(cls, meta: dict[str, Any]) -> ErrorReply:
        code = meta.get("code")
        if isinstance(code, bool) or not isinstance(code, int):
            raise ProtocolError("error: field 'code' missing")
        message = meta.get("message", "")
        retry = meta.get("retry_after_ms")
        if retry is not None and (isinstance(retry, bool) or not isinstance(retry, int)):
            retry = None
        try:
            ecode = ErrorCode(code)
        except ValueError:
            ecode = ErrorCode.INTERNAL
            message = f"unknown error code {code}: {message}"
        again = meta.get("retry", False) is True and ecode is ErrorCode.UNAVAILABLE
        return cls(request_id_of(meta), ecode, str(message), retry, again)


def encode_error(error: ErrorReply, *, simple: bool = False) -> list[bytes]:
    """Frames of an error reply, framed or in the simple form."""
    if simple:
        wire = error.to_wire()
        rid = wire.pop("id")
        return [pack({"v": PROTOCOL_VERSION, "id": rid, "error": wire})]
    return [_ERROR, pack(error.to_wire())]


def reply_wire(
    request_id: int,
    outputs: list[dict[str, Any]],
    batch_size: int,
    queue_ms: float,
    compute_ms: float,
) -> dict[str, Any]:
    """A REPLY meta from its fields; ``outputs`` are descriptor maps (:func:`tensor_wire`,
    with ``shm`` from :func:`output_ref_wire` for an output in a worker's ring)."""
    return {
        "id": request_id,
        "outputs": outputs,
        "batch_size": batch_size,
        "queue_ms": round(queue_ms, 3),
        "compute_ms": round(compute_ms, 3),
    }


def reply_frames(
    meta: dict[str, Any], payloads: Sequence[object], *, simple: bool = False
) -> list[Any]:
    """Frames of a successful reply whose meta :func:`reply_wire` built: framed, or in
    the simple form (one frame, payloads inline; ``meta`` is not changed)."""
    if simple:
        wire = dict(meta)
        wire["v"] = PROTOCOL_VERSION
        wire["outputs"] = [
            {**t, "data": bytes(memoryview(data))}  # type: ignore[arg-type]
            for t, data in zip(meta["outputs"], payloads, strict=True)
        ]
        return [pack(wire)]
    return [_REPLY, pack(meta), *payloads]


def encode_reply(reply: ReplyMeta, payloads: Sequence[object], *, simple: bool) -> list[Any]:
    """Frames of a successful reply, framed or in the simple form (payloads inline)."""
    return reply_frames(reply.to_wire(), payloads, simple=simple)


@dataclass(frozen=True, slots=True)
class Cancel:
    """CANCEL meta: the client no longer needs request ``request_id`` (§6.5). Only a
    request sent with the same ``client`` nonce (and, with CURVE, by the same key) is
    cancelled; the CANCEL itself is never answered."""

    request_id: int
    client: bytes

    def to_wire(self) -> dict[str, Any]:
        return {"id": self.request_id, "client": self.client}

    def to_frames(self) -> list[Any]:
        return [_CANCEL, pack(self.to_wire())]

    @classmethod
    def from_wire(cls, meta: dict[str, Any]) -> Cancel:
        rid = request_id_of(meta)
        if rid is None:
            raise ProtocolError("cancel: field 'id' missing or not an unsigned 64-bit int")
        nonce = client_nonce_of(meta, "cancel")
        if nonce is None:
            raise ProtocolError("cancel: field 'client' (the requests' nonce) missing")
        return cls(rid, nonce)
