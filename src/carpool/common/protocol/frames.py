"""frames.py: the frame layer of protocol v1 — header, commands, limits, meta maps — pure.

Every message (after the ROUTER's routing-id frame) is ``[header, meta, *tensor frames]``:
a 4-byte header ``b"CP" <version:u8> <command:u8>``, a msgpack map, then raw tensor bytes
(the layout is drawn in :mod:`carpool.common.protocol`). This module parses and builds the
header, decodes the meta map, and holds the field checks the message modules share. No
I/O, no clock, no logging; decoders raise :class:`ProtocolError`, never ``assert``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import IntEnum
from typing import Any, Protocol

from carpool.common import codec
from carpool.common.errors import ProtocolError

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


def decode_meta(frame: bytes | memoryview) -> dict[str, Any]:
    """Decode a meta frame into a map (bounded in size)."""
    meta = codec.unpack(frame)
    return meta if type(meta) is dict else require_map(meta, "meta")


def encode(command: Command, meta: dict[str, Any], payloads: Sequence[object] = ()) -> list[Any]:
    """Frames of any message: header, packed meta, payload frames."""
    return [header(command), codec.pack(meta), *payloads]
