"""frames.py: the frame layer of protocol v1 — header, commands, limits, meta maps and
their msgpack, tensor descriptors and their dtypes — pure.

Every message (after the ROUTER's routing-id frame) is ``[header, meta, *tensor frames]``:
a 4-byte header ``b"CP" <version:u8> <command:u8>``, a msgpack map, then raw tensor bytes
(the layout is drawn in :mod:`carpool.common.protocol`). This module parses and builds the
header, decodes the meta map, and holds the field checks the message modules share. No
I/O, no clock, no logging; decoders raise :class:`ProtocolError`, never ``assert``.

msgpack (:func:`pack`, :func:`unpack`) is imported here only. It never uses pickle or ext
types, always packs with ``use_bin_type=True`` and unpacks with ``raw=False`` and
``strict_map_key=True``, and keeps every size limit on.

A tensor descriptor ``{name, dtype, shape}`` (protocol §5.1) names one tensor of a
message, whose bytes follow in its own frame (or lie in shared memory, :mod:`.refs`).
This module holds the wire dtypes (:data:`DTYPES`), validates descriptors, computes the
signature under which a validated layout is remembered, and checks that frames are as
long as their descriptors say.
"""

from __future__ import annotations

import math
from _thread import _local as thread_local  # threading.local, without the threading module
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Protocol

import msgpack
import numpy as np

from carpool.common.errors import ProtocolError, as_sent
from carpool.common.protocol.refs import MAX_REF_BYTES

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


#: Largest meta (header) frame anyone should send; bigger ones are rejected unread.
MAX_META_BYTES = 64 * 1024
#: Largest single-frame ("simple form") request, tensors inline.
MAX_SIMPLE_BYTES = 64 * 1024 * 1024

#: Wire dtype names and their numpy dtypes (always little-endian on the wire).
DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(name).newbyteorder("<")
    for name in (
        "bool",
        "uint8",
        "int8",
        "uint16",
        "int16",
        "uint32",
        "int32",
        "uint64",
        "int64",
        "float16",
        "float32",
        "float64",
    )
}


#: Bytes per element of each wire dtype.
ITEMSIZE: dict[str, int] = {name: dt.itemsize for name, dt in DTYPES.items()}


#: numpy dtypes (either byte order) to wire names: one lookup for the common case.
_WIRE_NAMES: dict[np.dtype[Any], str] = {
    dt: name for name, little in DTYPES.items() for dt in (little, little.newbyteorder(">"))
}


def wire_dtype(dtype: np.dtype[Any] | str | type) -> str:
    """The wire name of a numpy dtype; raises ProtocolError for unsupported ones."""
    if isinstance(dtype, np.dtype):
        name = _WIRE_NAMES.get(dtype)
        if name is not None:
            return name
    dt = np.dtype(dtype)
    name = dt.name  # byte order is not part of the name: senders convert to little-endian
    if name not in DTYPES:
        raise ProtocolError(f"unsupported dtype {dt!s}; supported: {', '.join(DTYPES)}")
    return name


def numpy_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype of a wire dtype name; raises ProtocolError for unknown names."""
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise ProtocolError(f"unsupported dtype {name!r}; supported: {', '.join(DTYPES)}") from None


# (Imported from _thread, where threading.local lives, so that importing the protocol
# loads no threading machinery: the protocol package is held to pure imports.)
_packers = thread_local()
#: A Packer whose output was larger than this is not kept (its buffer would stay that big).
_PACKER_KEEP_BYTES = 1 << 20


def pack(obj: object) -> bytes:
    """msgpack-encode ``obj`` (maps, lists, str, bytes, ints, floats, bool, None).

    One ``Packer`` per thread, reused, where ``msgpack.packb`` builds a new one each time
    (speed: docs/benchmarks.md "Why the hot path looks as it does"). A Packer resets
    itself after each call, also when the object cannot be packed, but keeps its buffer at
    the largest size it ever needed: after a large object (a simple-form message carries its tensors
    inline, up to 64 MiB) the thread's Packer is dropped. Not reentrant: nothing packed
    here may call back into ``pack`` (no ``default`` hook, plain containers only)."""
    try:
        packer = _packers.packer
    except AttributeError:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    out: bytes = packer.pack(obj)
    if len(out) > _PACKER_KEEP_BYTES:
        del _packers.packer
    return out


def _no_ext(code: int, data: bytes) -> Any:
    """Protocol §4: extension types MUST NOT be used (an empty ext 8/16/32 got through
    ``max_ext_len=0``)."""
    raise ValueError(f"extension type {code} is not allowed")


def unpack(data: Frame, *, max_bytes: int = MAX_META_BYTES, use_list: bool = True) -> Any:
    """Decode one msgpack object (from bytes, a memoryview or a zmq.Frame), refusing
    anything larger than ``max_bytes``; ``use_list`` False: its arrays as tuples.

    Raises:
        ProtocolError: the data is too large, malformed, or has trailing bytes.
    """
    if len(data) > max_bytes:
        raise ProtocolError(f"msgpack frame of {len(data)} bytes exceeds {max_bytes}")
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=use_list,
            max_bin_len=max_bytes,
            max_str_len=max_bytes,
            max_array_len=max_bytes,
            max_map_len=max_bytes,
            max_ext_len=0,  # (bounds an extension's body, but lets an empty one by)
            ext_hook=_no_ext,
        )
    except Exception as exc:  # msgpack raises a zoo of types on bad input
        raise ProtocolError(f"malformed msgpack: {exc}") from None


class Command(IntEnum):
    """Command byte of the header frame."""

    REQUEST = 0x01
    REPLY = 0x02
    ERROR = 0x03
    STATS = 0x04
    CANCEL = 0x05
    METADATA = 0x06
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


#: Priority by its wire value, an index.
# speed: docs/benchmarks.md "Why the hot path looks as it does"
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


def require_field(meta: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = meta.get(key)
    # bool is an int subclass; never accept it where a number is meant.
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
        raise ProtocolError(f"{what}: field {key!r} missing or not {_kind_name(kind)}")
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    return "/".join(k.__name__ for k in _as_tuple(kind))


def require_map(obj: Any, what: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what}: expected a msgpack map")
    return obj


def require_name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_NAME_CHARS:
        raise ProtocolError(f"{what}: name must be a non-empty string of <= {MAX_NAME_CHARS}")
    return value


def optional_number(meta: dict[str, Any], key: str, default: float = 0.0) -> float:
    value = meta.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ProtocolError(f"field {key!r} must be a finite number")
    return float(value)


def decode_meta(frame: Frame, use_list: bool = True) -> dict[str, Any]:
    """A meta frame (bytes, memoryview, zmq.Frame) as a map, by :func:`unpack`'s rules
    and limits; ``use_list`` False: its arrays as tuples (hashable where their items are)."""
    meta = unpack(frame, use_list=use_list)
    return meta if type(meta) is dict else require_map(meta, "meta")


def encode(command: Command, meta: dict[str, Any], payloads: Sequence[object] = ()) -> list[Any]:
    """Frames of any message: header, packed meta, payload frames."""
    return [header(command), pack(meta), *payloads]


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Name, wire dtype and shape of one tensor. ``-1`` marks a dynamic dim in a spec."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Payload size in bytes (only meaningful when no dim is dynamic)."""
        return math.prod(self.shape) * ITEMSIZE[self.dtype]

    def to_wire(self) -> dict[str, Any]:
        return tensor_wire(self.name, self.dtype, list(self.shape))

    @classmethod
    def from_wire(
        cls, obj: Any, *, allow_dynamic: bool = False, allow_empty: bool = False
    ) -> TensorMeta:
        """A descriptor checked (§5.1). ``allow_dynamic``: dims may be -1 (model specs);
        ``allow_empty``: dims after the batch dim may be 0 (replies: a detector that
        found nothing answers ``[n, 0, 6]``)."""
        m = require_map(obj, "tensor")
        name = require_name(m.get("name"), "tensor")
        dtype = m.get("dtype")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise ProtocolError(f"tensor {name!r}: unsupported dtype {as_sent(dtype)}")
        shape = m.get("shape")
        if not isinstance(shape, (list, tuple)) or not 1 <= len(shape) <= MAX_RANK:
            # Rank >= 1: dim 0 is the batch (sample) dimension.
            raise ProtocolError(f"tensor {name!r}: shape must be a list of 1..{MAX_RANK} ints")
        low = -1 if allow_dynamic else 1
        empty = False
        for i, d in enumerate(shape):
            if isinstance(d, bool) or not isinstance(d, int) or d < low or d == 0:
                if d == 0 and allow_empty and i > 0 and type(d) is int:
                    empty = True
                    continue
                raise ProtocolError(
                    f"tensor {name!r}: bad dimension {as_sent(d)} in shape {as_sent(shape)}"
                )
        if empty:
            # An empty payload bounds nothing: the other dims could describe an array no
            # client can build (numpy refuses [1, 0, 2**61] float32). §14's limit.
            span = empty_span_bytes(shape, ITEMSIZE[dtype])
            if span > MAX_EMPTY_SPAN_BYTES:
                raise ProtocolError(
                    f"tensor {name!r}: shape {list(shape)} spans {span} bytes without its zero "
                    f"dims; at most {MAX_EMPTY_SPAN_BYTES}"
                )
        return cls(name, dtype, tuple(shape))


def tensor_wire(name: str, dtype: str, shape: list[int]) -> dict[str, Any]:
    """A tensor descriptor map: the one encoder of ``{name, dtype, shape}`` (callers that
    hold the fields build descriptors without a :class:`TensorMeta`).
    speed: docs/benchmarks.md "Why the hot path looks as it does"."""
    return {"name": name, "dtype": dtype, "shape": shape}


def empty_span_bytes(shape: Sequence[int], itemsize: int) -> int:
    """Bytes a shape spans with its zero dims read as 1 (§14 bounds it for empty tensors)."""
    return itemsize * math.prod(d or 1 for d in shape)


def tensor_list(
    obj: Any, what: str, *, allow_dynamic: bool = False, allow_empty: bool = False
) -> tuple[TensorMeta, ...]:
    if not isinstance(obj, (list, tuple)) or not obj or len(obj) > MAX_TENSORS:
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
            if t.nbytes > MAX_REF_BYTES:
                raise ProtocolError(
                    f"tensor {t.name!r}: {t.nbytes} bytes in shared memory, at most "
                    f"{MAX_REF_BYTES} per tensor"
                )
            continue
        if len(f) != t.nbytes:
            raise ProtocolError(
                f"tensor {t.name!r}: {t.dtype}{list(t.shape)} needs {t.nbytes} bytes, "
                f"frame has {len(f)}"
            )
