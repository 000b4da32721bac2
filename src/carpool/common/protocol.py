"""protocol.py: carpool wire protocol v1 — frame layout, commands, messages, encode/decode.

Rules: pure. No sockets, no clock, no logging. Decoders validate everything that came off
the network and raise :class:`ProtocolError` (never ``assert``). docs/protocol.md is the
normative description; this docstring is the summary.

Every message (after the ROUTER's routing-id frame, which only the broker sees) is::

    frame 0   header   4 bytes: b"C" b"P" <version:u8> <command:u8>
    frame 1   meta     msgpack map (at most 64 KiB)
    frame 2.. tensors  raw little-endian C-order bytes, one frame per tensor, in meta order

Client ↔ broker (client DEALER or REQ → broker frontend ROUTER)::

    REQUEST  C→B  meta {id, model, timeout_ms?, inputs: [{name, dtype, shape}], priority?}
    REPLY    B→C  meta {id, outputs: [{name, dtype, shape}], batch_size, queue_ms, compute_ms}
    ERROR    B→C  meta {id, code, message, retry_after_ms?}                (no tensor frames)
    STATS    C→B  meta {id?}       B→C meta {broker counters, id?}

    The simple form: one msgpack frame (a map, so its first byte is never b"C"):
    {v: 1, id, model, timeout_ms, inputs: [{name, dtype, shape, data: bin}]}; the reply comes
    back in the same form: {v: 1, id, outputs: [{..., data}]} or {v: 1, id, error: {...}}.

Worker ↔ broker (worker DEALER → broker backend ROUTER)::

    READY      W→B  meta {name, slots, heartbeat_ms,
                          models: [{name, inputs, outputs, max_batch, preferred_batch}]}
    HEARTBEAT  W↔B  meta {rho?}
    BATCH      B→W  meta {batch, model, inputs: [{name, dtype, shape: [-1, ...]}],
                          requests: [{id, n, simple, queue_ms}]}
                    frames: request-major, one frame per (request, input)
    RESULT     W→B  meta {batch, rho, compute_ms, frames: [k_i]} then, per request, the k_i
                    frames of the finished client reply (REPLY or ERROR, or one simple frame)
    FAILED     W→B  meta {batch, code, message, rho}
    DISCONNECT W↔B  meta {reason}
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Protocol

from carpool.common import codec, shm
from carpool.common.errors import ErrorCode, ProtocolError
from carpool.common.shape_rules import ShapeRule

MAGIC = b"CP"
PROTOCOL_VERSION = 1
HEADER_BYTES = 4
MAX_TENSORS = 64
MAX_RANK = 8
MAX_TIMEOUT_MS = 3_600_000
MAX_NAME_CHARS = 256
MAX_MODELS = 256  # a READY's models
#: An empty reply tensor's shape, its zero dims read as 1, spans at most this many bytes.
MAX_EMPTY_SPAN_BYTES = 1 << 48


class Command(IntEnum):
    """Command byte of the header frame."""

    REQUEST = 0x01
    REPLY = 0x02
    ERROR = 0x03
    STATS = 0x04
    READY = 0x10
    HEARTBEAT = 0x11
    BATCH = 0x12
    RESULT = 0x13
    FAILED = 0x14
    DISCONNECT = 0x15


class Priority(IntEnum):
    """Request priority on the wire; lower is more urgent."""

    INTERACTIVE = 0
    BULK = 1


#: Priority by its wire value (an index is cheaper than the enum call).
PRIORITIES = (Priority.INTERACTIVE, Priority.BULK)


class Frame(Protocol):
    """Anything that can travel as a frame: bytes, memoryview, zmq.Frame."""

    def __len__(self) -> int: ...


def view(frame: Frame) -> memoryview:
    """A zero-copy view of a frame's bytes (bytes, memoryview and zmq.Frame all qualify)."""
    return memoryview(frame)  # type: ignore[arg-type]


_HEADERS: dict[Command, bytes] = {cmd: MAGIC + bytes((PROTOCOL_VERSION, cmd)) for cmd in Command}


_COMMANDS: dict[bytes, Command] = {h: cmd for cmd, h in _HEADERS.items()}


def header(command: Command) -> bytes:
    """The 4-byte header frame for ``command`` at our protocol version."""
    return _HEADERS[command]


class VersionMismatch(ProtocolError):
    """The header is well-formed but names a protocol version we do not speak."""

    def __init__(self, version: int) -> None:
        super().__init__(
            f"unsupported protocol version {version}; this peer speaks {PROTOCOL_VERSION}"
        )
        self.version = version


def parse_header(frame: bytes | memoryview) -> Command:
    """Parse a header frame.

    Raises:
        VersionMismatch: valid magic, other version.
        ProtocolError: anything else that is not a v1 header with a known command.
    """
    command = _COMMANDS.get(bytes(frame))  # the common case: a v1 header, one lookup
    if command is not None:
        return command
    if len(frame) != HEADER_BYTES or bytes(frame[:2]) != MAGIC:
        raise ProtocolError("not a carpool header frame (expected b'CP' + version + command)")
    version = frame[2]
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(version)
    try:
        return Command(frame[3])
    except ValueError:
        raise ProtocolError(f"unknown command 0x{frame[3]:02x}") from None


def is_simple_form(frame: bytes | memoryview) -> bool:
    """True when a lone frame looks like a msgpack map (the single-frame simple form)."""
    if len(frame) == 0:
        return False
    first = frame[0]
    return 0x80 <= first <= 0x8F or first in (0xDE, 0xDF)


# --------------------------------------------------------------------------- helpers


def _field(meta: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = meta.get(key)
    # bool is an int subclass; never accept it where a number is meant.
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
        raise ProtocolError(f"{what}: field {key!r} missing or not {_kind_name(kind)}")
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    return "/".join(k.__name__ for k in _as_tuple(kind))


def _map(obj: Any, what: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what}: expected a msgpack map")
    return obj


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_NAME_CHARS:
        raise ProtocolError(f"{what}: name must be a non-empty string of <= {MAX_NAME_CHARS}")
    return value


def _optional_number(meta: dict[str, Any], key: str, default: float = 0.0) -> float:
    value = meta.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ProtocolError(f"field {key!r} must be a finite number")
    return float(value)


def decode_meta(frame: bytes | memoryview) -> dict[str, Any]:
    """Decode a meta frame into a map (bounded in size)."""
    return _map(codec.unpack(frame), "meta")


# --------------------------------------------------------------------------- tensors


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Name, wire dtype and shape of one tensor. ``-1`` marks a dynamic dim in a spec."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Payload size in bytes (only meaningful when no dim is dynamic)."""
        return math.prod(self.shape) * codec.ITEMSIZE[self.dtype]

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_wire(
        cls, obj: Any, *, allow_dynamic: bool = False, allow_empty: bool = False
    ) -> TensorMeta:
        """A descriptor checked (§5.1). ``allow_dynamic``: dims may be -1 (model specs);
        ``allow_empty``: dims after the batch dim may be 0 (replies: a detector that
        found nothing answers ``[n, 0, 6]``)."""
        m = _map(obj, "tensor")
        name = _name(m.get("name"), "tensor")
        dtype = m.get("dtype")
        if not isinstance(dtype, str) or dtype not in codec.DTYPES:
            raise ProtocolError(f"tensor {name!r}: unsupported dtype {dtype!r}")
        shape = m.get("shape")
        if not isinstance(shape, list) or not 1 <= len(shape) <= MAX_RANK:
            # Rank >= 1: dim 0 is the batch (sample) dimension.
            raise ProtocolError(f"tensor {name!r}: shape must be a list of 1..{MAX_RANK} ints")
        low = -1 if allow_dynamic else 1
        empty = False
        for i, d in enumerate(shape):
            if isinstance(d, bool) or not isinstance(d, int) or d < low or d == 0:
                if d == 0 and allow_empty and i > 0 and type(d) is int:
                    empty = True
                    continue
                raise ProtocolError(f"tensor {name!r}: bad dimension {d!r} in shape {shape}")
        if empty:
            # An empty payload bounds nothing: the other dims could describe an array no
            # client can build (numpy refuses [1, 0, 2**61] float32). §14's limit.
            span = empty_span_bytes(shape, codec.ITEMSIZE[dtype])
            if span > MAX_EMPTY_SPAN_BYTES:
                raise ProtocolError(
                    f"tensor {name!r}: shape {shape} spans {span} bytes without its zero "
                    f"dims; at most {MAX_EMPTY_SPAN_BYTES}"
                )
        return cls(name, dtype, tuple(shape))


def empty_span_bytes(shape: Sequence[int], itemsize: int) -> int:
    """Bytes a shape spans with its zero dims read as 1 (§14 bounds it for empty tensors)."""
    return itemsize * math.prod(d or 1 for d in shape)


def _tensor_list(
    obj: Any, what: str, *, allow_dynamic: bool = False, allow_empty: bool = False
) -> tuple[TensorMeta, ...]:
    if not isinstance(obj, list) or not obj or len(obj) > MAX_TENSORS:
        raise ProtocolError(f"{what}: expected a list of 1..{MAX_TENSORS} tensors")
    tensors = tuple(
        TensorMeta.from_wire(t, allow_dynamic=allow_dynamic, allow_empty=allow_empty) for t in obj
    )
    if len({t.name for t in tensors}) != len(tensors):
        raise ProtocolError(f"{what}: duplicate tensor names")
    return tensors


#: (name, dtype, shape) per tensor descriptor: the key under which a layout that passed
#: full validation is remembered.
Signature = tuple[tuple[str, str, tuple[int, ...]], ...]


def tensor_signature(descriptors: Any) -> Signature | None:
    """The signature of wire tensor descriptors, for looking up a layout validated before;
    None if they are not maps with a str name and dtype and a list-of-ints shape. Says
    nothing of validity itself (a bool, float or bin shape would hash like the ints it
    resembles, so those are refused here rather than matched)."""
    if type(descriptors) is not list:
        return None
    sig = []
    for t in descriptors:
        if type(t) is not dict:
            return None
        name, dtype, shape = t.get("name"), t.get("dtype"), t.get("shape")
        if type(name) is not str or type(dtype) is not str or type(shape) is not list:
            return None
        for d in shape:
            if type(d) is not int:
                return None
        sig.append((name, dtype, tuple(shape)))
    return tuple(sig)


#: Where one input's bytes are, when not in its frame: (region, offset, key), §5.4.
ShmRef = shm.ShmRef


def check_frame_sizes(
    tensors: Sequence[TensorMeta],
    frames: Sequence[Frame],
    refs: Sequence[object | None] | None = None,
) -> None:
    """Check one frame per tensor, each exactly as long as its dtype and shape say (and
    empty for a tensor whose bytes are in shared memory, §5.4)."""
    if len(frames) != len(tensors):
        raise ProtocolError(f"expected {len(tensors)} tensor frames, got {len(frames)}")
    for i, (t, f) in enumerate(zip(tensors, frames, strict=True)):
        if refs is not None and refs[i] is not None:
            if len(f):
                raise ProtocolError(
                    f"tensor {t.name!r} is in shared memory: its frame must be empty, "
                    f"it has {len(f)} bytes"
                )
            if t.nbytes > shm.MAX_REF_BYTES:
                raise ProtocolError(
                    f"tensor {t.name!r}: {t.nbytes} bytes in shared memory, at most "
                    f"{shm.MAX_REF_BYTES} per tensor"
                )
            continue
        if len(f) != t.nbytes:
            raise ProtocolError(
                f"tensor {t.name!r}: {t.dtype}{list(t.shape)} needs {t.nbytes} bytes, "
                f"frame has {len(f)}"
            )


# --------------------------------------------------------------------------- client side


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

    def to_wire(self) -> dict[str, Any]:
        inputs = [t.to_wire() for t in self.inputs]
        if self.shm is not None:
            for t, ref in zip(inputs, self.shm, strict=True):
                if ref is not None:
                    t["shm"] = shm.ref_wire(ref)
        meta: dict[str, Any] = {
            "id": self.request_id,
            "model": self.model,
            "inputs": inputs,
        }
        if self.timeout_ms is not None:
            meta["timeout_ms"] = self.timeout_ms
        if self.priority != Priority.INTERACTIVE:
            meta["priority"] = int(self.priority)
        if self.shm_outputs:
            meta["shm_outputs"] = True
        return meta


def request_id_of(meta: Any) -> int | None:
    """Best-effort request id of a (possibly invalid) request meta, for error replies."""
    if isinstance(meta, dict):
        rid = meta.get("id")
        if isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid < 2**64:
            return rid
    return None


def decode_submit(meta: dict[str, Any]) -> Submit:
    """Validate a REQUEST meta (or a simple-form map) into a :class:`Submit`."""
    rid = request_id_of(meta)
    if rid is None:
        raise ProtocolError("request: field 'id' missing or not an unsigned 64-bit int")
    model = _name(meta.get("model"), "request model")
    timeout = meta.get("timeout_ms")
    if timeout is not None and (
        isinstance(timeout, bool)
        or not isinstance(timeout, int)
        or not 0 < timeout <= MAX_TIMEOUT_MS
    ):
        raise ProtocolError(f"request: timeout_ms must be an int in 1..{MAX_TIMEOUT_MS}")
    prio = meta.get("priority", 0)
    if type(prio) is not int or prio not in (0, 1):
        raise ProtocolError("request: priority must be 0 (interactive) or 1 (bulk)")
    raw = meta.get("inputs")
    inputs = _tensor_list(raw, "request inputs")
    assert isinstance(raw, list)  # _tensor_list checked it
    shm_outputs = meta.get("shm_outputs", False)
    if type(shm_outputs) is not bool:
        raise ProtocolError("request: shm_outputs must be true or false")
    return Submit(rid, model, timeout, inputs, PRIORITIES[prio], shm_refs(raw), shm_outputs)


def shm_refs(descriptors: list[Any]) -> tuple[ShmRef | None, ...] | None:
    """The ``shm`` references of a request's input descriptors (§5.4); None if none has
    one. The descriptors are maps (validated before)."""
    refs: list[ShmRef | None] | None = None
    for i, t in enumerate(descriptors):
        obj = t.get("shm")
        if obj is None:
            continue
        if refs is None:
            refs = [None] * len(descriptors)
        refs[i] = shm.parse_ref(obj, f"tensor {t.get('name')!r}")
    return None if refs is None else tuple(refs)


def encode_request(submit: Submit, payloads: Sequence[object]) -> list[Any]:
    """Frames of a REQUEST (for a DEALER client)."""
    return [header(Command.REQUEST), codec.pack(submit.to_wire()), *payloads]


def decode_simple_request(frame: bytes | memoryview) -> tuple[Submit, list[bytes]]:
    """Decode a single-frame simple-form request into a Submit and its payloads.

    The inline ``data`` fields are copied out of msgpack; this form is meant for small
    tensors from small devices. Large tensors belong in the framed form.
    """
    obj = _map(codec.unpack(frame, max_bytes=codec.MAX_SIMPLE_BYTES), "simple request")
    try:
        version = obj.get("v")
        if type(version) is not int:
            raise ProtocolError("simple request: field 'v' (protocol version) missing")
        if version != PROTOCOL_VERSION:
            raise VersionMismatch(version)
        submit = decode_submit(obj)
        if submit.shm is not None or submit.shm_outputs:
            raise ProtocolError("simple request: shared memory needs the framed form")
        payloads: list[bytes] = []
        for raw, t in zip(obj["inputs"], submit.inputs, strict=True):
            data = raw.get("data")
            if not isinstance(data, bytes):
                raise ProtocolError(f"simple request: tensor {t.name!r} has no bin 'data' field")
            payloads.append(data)
        check_frame_sizes(submit.inputs, payloads)
    except ProtocolError as exc:
        exc.meta = obj
        raise
    return submit, payloads


def encode_simple_request(submit: Submit, payloads: Sequence[bytes]) -> bytes:
    """The one frame of a simple-form request."""
    meta = submit.to_wire()
    meta["v"] = PROTOCOL_VERSION
    for t, data in zip(meta["inputs"], payloads, strict=True):
        t["data"] = bytes(data)
    return codec.pack(meta)


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
    shm: tuple[shm.OutputRef | None, ...] | None = None

    def to_wire(self) -> dict[str, Any]:
        outputs = [t.to_wire() for t in self.outputs]
        if self.shm is not None:
            for t, ref in zip(outputs, self.shm, strict=True):
                if ref is not None:
                    t["shm"] = shm.output_ref_wire(ref)
        return {
            "id": self.request_id,
            "outputs": outputs,
            "batch_size": self.batch_size,
            "queue_ms": round(self.queue_ms, 3),
            "compute_ms": round(self.compute_ms, 3),
        }

    @classmethod
    def from_wire(cls, meta: dict[str, Any]) -> ReplyMeta:
        rid = request_id_of(meta)
        if rid is None:
            raise ProtocolError("reply: field 'id' missing")
        raw = meta.get("outputs")
        outputs = _tensor_list(raw, "reply outputs", allow_empty=True)
        assert isinstance(raw, list)  # _tensor_list checked it
        refs: list[shm.OutputRef | None] | None = None
        for i, t in enumerate(raw):
            obj = t.get("shm")
            if obj is not None:
                if refs is None:
                    refs = [None] * len(raw)
                refs[i] = shm.parse_output_ref(obj, f"reply tensor {t.get('name')!r}")
        batch_size = meta.get("batch_size", 0)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int):
            raise ProtocolError("reply: batch_size must be an int")
        return cls(
            rid,
            outputs,
            batch_size,
            _optional_number(meta, "queue_ms"),
            _optional_number(meta, "compute_ms"),
            None if refs is None else tuple(refs),
        )


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """ERROR meta: why a request (or an unreadable message) failed."""

    request_id: int | None
    code: ErrorCode
    message: str
    retry_after_ms: int | None = None

    def to_wire(self) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.request_id,
            "code": int(self.code),
            "message": self.message,
        }
        if self.retry_after_ms is not None:
            meta["retry_after_ms"] = self.retry_after_ms
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
        return cls(request_id_of(meta), ecode, str(message), retry)


def encode_error(error: ErrorReply, *, simple: bool = False) -> list[bytes]:
    """Frames of an error reply, framed or in the simple form."""
    if simple:
        wire = error.to_wire()
        rid = wire.pop("id")
        return [codec.pack({"v": PROTOCOL_VERSION, "id": rid, "error": wire})]
    return [header(Command.ERROR), codec.pack(error.to_wire())]


def encode_reply(reply: ReplyMeta, payloads: Sequence[object], *, simple: bool) -> list[Any]:
    """Frames of a successful reply, framed or in the simple form (payloads inline)."""
    if simple:
        wire = reply.to_wire()
        wire["v"] = PROTOCOL_VERSION
        for t, data in zip(wire["outputs"], payloads, strict=True):
            t["data"] = bytes(memoryview(data))  # type: ignore[arg-type]
        return [codec.pack(wire)]
    return [header(Command.REPLY), codec.pack(reply.to_wire()), *payloads]


# --------------------------------------------------------------------------- worker side


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What a worker serves for one model: I/O specs (dim 0 is the batch) and batch limits."""

    name: str
    inputs: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]
    max_batch: int
    # Batch sizes the engine runs best at (TensorRT profile sizes); empty means any.
    preferred_batch: tuple[int, ...] = ()
    # Limits on each input's dims beyond its shape, in input order; () when none has any.
    rules: tuple[ShapeRule | None, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        inputs = [t.to_wire() for t in self.inputs]
        for descriptor, rule in zip(inputs, self.rules or [None] * len(inputs), strict=True):
            if rule:
                descriptor.update(rule.to_wire())
        return {
            "name": self.name,
            "inputs": inputs,
            "outputs": [t.to_wire() for t in self.outputs],
            "max_batch": self.max_batch,
            "preferred_batch": list(self.preferred_batch),
        }

    @classmethod
    def from_wire(cls, obj: Any) -> ModelSpec:
        m = _map(obj, "model spec")
        name = _name(m.get("name"), "model spec")
        inputs = _tensor_list(m.get("inputs"), f"model {name} inputs", allow_dynamic=True)
        rules = tuple(
            ShapeRule.from_wire(d, len(t.shape), f"model {name} input {t.name!r}")
            for d, t in zip(m["inputs"], inputs, strict=True)
        )
        outputs = _tensor_list(m.get("outputs"), f"model {name} outputs", allow_dynamic=True)
        max_batch = _field(m, "max_batch", int, f"model {name}")
        if max_batch < 1:
            raise ProtocolError(f"model {name}: max_batch must be >= 1")
        preferred = m.get("preferred_batch", [])
        if not isinstance(preferred, list) or not all(
            isinstance(p, int) and not isinstance(p, bool) and 1 <= p <= max_batch
            for p in preferred
        ):
            raise ProtocolError(f"model {name}: preferred_batch must list ints in 1..max_batch")
        return cls(
            name,
            inputs,
            outputs,
            max_batch,
            tuple(sorted(set(preferred))),
            rules if any(rules) else (),
        )


@dataclass(frozen=True, slots=True)
class Ready:
    """READY meta: a worker announces itself and what it serves."""

    name: str
    # How many batches the broker may have outstanding at this worker (credits).
    slots: int
    models: tuple[ModelSpec, ...]
    # The worker's heartbeat interval; the broker heartbeats it at the same rate.
    heartbeat_ms: int = 1000

    def to_wire(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "slots": self.slots,
            "models": [m.to_wire() for m in self.models],
            "heartbeat_ms": self.heartbeat_ms,
        }

    @classmethod
    def from_wire(cls, meta: dict[str, Any]) -> Ready:
        name = _name(meta.get("name"), "ready")
        slots = _field(meta, "slots", int, "ready")
        if not 1 <= slots <= 1024:
            raise ProtocolError("ready: slots must be in 1..1024")
        models = meta.get("models")
        if not isinstance(models, list) or not models or len(models) > MAX_MODELS:
            raise ProtocolError(f"ready: models must be a list of 1..{MAX_MODELS} model specs")
        specs = tuple(ModelSpec.from_wire(m) for m in models)
        if len({s.name for s in specs}) != len(specs):
            raise ProtocolError("ready: duplicate model names")
        heartbeat_ms = meta.get("heartbeat_ms", 1000)
        if isinstance(heartbeat_ms, bool) or not isinstance(heartbeat_ms, int):
            raise ProtocolError("ready: heartbeat_ms must be an int")
        if not 10 <= heartbeat_ms <= 600_000:
            raise ProtocolError("ready: heartbeat_ms must be in 10..600000")
        return cls(name, slots, specs, heartbeat_ms)


@dataclass(slots=True)
class BatchItem:
    """One request inside a BATCH. (Not frozen: a worker builds one per request of every
    batch, and a frozen dataclass's ``__init__`` costs ~4 x a plain one.)"""

    request_id: int
    samples: int
    simple: bool
    queue_ms: float
    # Per batch input, in spec order: where its bytes are in shared memory (§5.4), or
    # None for an input in its frame; None when all are in frames.
    shm: tuple[ShmRef | None, ...] | None = None
    # The client reads large outputs from this worker's ring (§5.5).
    shm_outputs: bool = False

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "id": self.request_id,
            "n": self.samples,
            "simple": self.simple,
            "queue_ms": round(self.queue_ms, 3),
        }
        if self.shm is not None:
            wire["shm"] = shm_wire(self.shm)
        if self.shm_outputs:
            wire["shm_outputs"] = True
        return wire


def shm_wire(refs: Sequence[ShmRef | None]) -> list[dict[str, Any] | None]:
    """BATCH ``requests[i].shm``: one map or nil per input."""
    return [None if r is None else shm.ref_wire(r) for r in refs]


def parse_batch_refs(obj: Any, n_inputs: int) -> tuple[ShmRef | None, ...]:
    """BATCH ``requests[i].shm``, checked: one reference or None per input."""
    if type(obj) is not list or len(obj) != n_inputs:
        raise ProtocolError(f"batch: a request's 'shm' must be a list of {n_inputs} entries")
    return tuple(
        None if r is None else shm.parse_ref(r, "batch request", ring_ok=True) for r in obj
    )


#: BATCH ``inputs`` lists that passed validation, by signature (a worker sees a few).
_BATCH_INPUTS: dict[Signature, tuple[TensorMeta, ...]] = {}
_MAX_BATCH_INPUTS = 256


@dataclass(slots=True)
class BatchMeta:
    """BATCH meta: requests of one model and one item shape, stacked along dim 0.
    (Not frozen, like BatchItem and ResultMeta: built per batch on the hot path.)"""

    batch_id: int
    model: str
    # Per-input spec with shape[0] == -1: each request brings `samples` rows.
    inputs: tuple[TensorMeta, ...]
    items: tuple[BatchItem, ...]
    _total: int = field(default=-1, repr=False, compare=False)

    @property
    def total_samples(self) -> int:
        total = self._total
        if total < 0:  # the items never change: summed once
            total = self._total = sum(i.samples for i in self.items)
        return total

    def to_wire(self) -> dict[str, Any]:
        return {
            "batch": self.batch_id,
            "model": self.model,
            "inputs": [t.to_wire() for t in self.inputs],
            "requests": [i.to_wire() for i in self.items],
        }

    @classmethod
    def from_wire(cls, meta: dict[str, Any]) -> BatchMeta:
        batch_id = _field(meta, "batch", int, "batch")
        model = _name(meta.get("model"), "batch model")
        raw_inputs = meta.get("inputs")
        # The same few input lists come in every batch: each validated once.
        sig = tensor_signature(raw_inputs)
        inputs = None if sig is None else _BATCH_INPUTS.get(sig)
        if inputs is None:
            inputs = _tensor_list(raw_inputs, "batch inputs", allow_dynamic=True)
            if sig is not None:
                if len(_BATCH_INPUTS) >= _MAX_BATCH_INPUTS:
                    _BATCH_INPUTS.clear()
                _BATCH_INPUTS[sig] = inputs
        reqs = meta.get("requests")
        if not isinstance(reqs, list) or not reqs:
            raise ProtocolError("batch: requests must be a non-empty list")
        items: list[BatchItem] = []
        append = items.append
        for r in reqs:  # per request of every batch: checks inlined, same rules
            if type(r) is not dict:
                _map(r, "batch request")  # raises with the usual message
            rid = r.get("id")
            n = r.get("n")
            if type(rid) is not int or not 0 <= rid < 2**64 or type(n) is not int or n < 1:
                raise ProtocolError("batch: each request needs an 'id' and 'n' >= 1")
            queue_ms = r.get("queue_ms", 0.0)
            if type(queue_ms) is not float or not math.isfinite(queue_ms):
                queue_ms = _optional_number(r, "queue_ms")
            refs = r.get("shm")
            if refs is not None:
                refs = parse_batch_refs(refs, len(inputs))
            append(
                BatchItem(
                    rid,
                    n,
                    bool(r.get("simple", False)),
                    queue_ms,
                    refs,
                    r.get("shm_outputs") is True,
                )
            )
        return cls(batch_id, model, inputs, tuple(items))

    def request_tensors(self, item: BatchItem) -> tuple[TensorMeta, ...]:
        """The concrete tensor metas of one request of this batch."""
        return tuple(TensorMeta(t.name, t.dtype, (item.samples, *t.shape[1:])) for t in self.inputs)


@dataclass(slots=True)
class ResultMeta:
    """RESULT meta: a finished batch. ``frames[i]`` frames of replies follow per request."""

    batch_id: int
    rho: float
    compute_ms: float
    frames: tuple[int, ...]

    def to_wire(self) -> dict[str, Any]:
        return {
            "batch": self.batch_id,
            "rho": round(self.rho, 4),
            "compute_ms": round(self.compute_ms, 3),
            "frames": list(self.frames),
        }

    @classmethod
    def from_wire(cls, meta: dict[str, Any]) -> ResultMeta:
        batch_id = _field(meta, "batch", int, "result")
        frames = meta.get("frames")
        if not isinstance(frames, list) or not all(
            isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in frames
        ):
            raise ProtocolError("result: frames must be a list of ints >= 1")
        return cls(
            batch_id,
            _optional_number(meta, "rho"),
            _optional_number(meta, "compute_ms"),
            tuple(frames),
        )


@dataclass(frozen=True, slots=True)
class FailedMeta:
    """FAILED meta: a batch the worker could not run."""

    batch_id: int
    code: ErrorCode
    message: str
    rho: float = 0.0

    def to_wire(self) -> dict[str, Any]:
        return {
            "batch": self.batch_id,
            "code": int(self.code),
            "message": self.message,
            "rho": round(self.rho, 4),
        }

    @classmethod
    def from_wire(cls, meta: dict[str, Any]) -> FailedMeta:
        batch_id = _field(meta, "batch", int, "failed")
        err = ErrorReply.from_wire(meta)
        return cls(batch_id, err.code, err.message, _optional_number(meta, "rho"))


def encode(command: Command, meta: dict[str, Any], payloads: Sequence[object] = ()) -> list[Any]:
    """Frames of any message: header, packed meta, payload frames."""
    return [header(command), codec.pack(meta), *payloads]
