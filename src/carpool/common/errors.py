"""The exception tree of carpool, and the wire error codes it maps to.

::

    CarpoolError
    ├── ProtocolError          a message that does not follow the wire protocol (local)
    ├── ConfigError            invalid configuration (local)
    └── RequestError           a request failed; carries the wire ErrorCode
        ├── InvalidArgument        INVALID_ARGUMENT: wrong dtype, shape, size, field
        │   └── UnsupportedVersion UNSUPPORTED_VERSION: protocol version not spoken
        ├── NotFound               NOT_FOUND: no worker has ever served that model
        ├── DeadlineExceeded       DEADLINE_EXCEEDED: the deadline passed or cannot be met
        ├── Overloaded             OVERLOADED: queue full; retry after ``retry_after_s``
        ├── Unavailable            UNAVAILABLE: no live worker, or no broker answering
        ├── InternalError          INTERNAL: the engine or the broker failed
        └── PermissionDenied       PERMISSION_DENIED: this key may not do that (STATS)

This module is pure: no I/O, no imports beyond the standard library.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

#: How deep :func:`as_sent` shows nested arrays and maps (deeper: ``...``).
SHOWN_DEPTH = 8


def as_sent(value: Any, depth: int = 0) -> str:
    """``repr`` of a decoded wire value as its sender wrote it, for an error message: an
    array, which a decoder may read as a tuple, shown as a list; nesting past
    :data:`SHOWN_DEPTH` shown as ``...`` (a peer may nest a thousand deep)."""
    if isinstance(value, (tuple, list)):
        if depth >= SHOWN_DEPTH:
            return "[...]"
        return "[" + ", ".join(as_sent(v, depth + 1) for v in value) + "]"
    if isinstance(value, dict):
        if depth >= SHOWN_DEPTH:
            return "{...}"
        items = (f"{as_sent(k, depth + 1)}: {as_sent(v, depth + 1)}" for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    return repr(value)


class ErrorCode(IntEnum):
    """Error codes on the wire (see docs/protocol.md). Values never change meaning."""

    INVALID_ARGUMENT = 1
    NOT_FOUND = 2
    DEADLINE_EXCEEDED = 3
    OVERLOADED = 4
    UNAVAILABLE = 5
    INTERNAL = 6
    UNSUPPORTED_VERSION = 7
    PERMISSION_DENIED = 8
    CANCELLED = 9


class CarpoolError(Exception):
    """Base class of every error carpool raises on purpose."""


class ProtocolError(CarpoolError):
    """A message does not follow the wire protocol.

    Attributes:
        meta: the decoded map of the offending message, when it could be decoded (so an
            error reply can still name the request id).
    """

    meta: object = None


class ConfigError(CarpoolError):
    """A configuration is invalid; the message lists every problem found."""


class RequestError(CarpoolError):
    """A request ended in an error reply.

    Attributes:
        code: the wire error code.
        request_id: the client's id of the request, when known.
    """

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, *, request_id: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.request_id = request_id


class InvalidArgument(RequestError):
    code = ErrorCode.INVALID_ARGUMENT


class UnsupportedVersion(InvalidArgument):
    code = ErrorCode.UNSUPPORTED_VERSION


class NotFound(RequestError):
    code = ErrorCode.NOT_FOUND


class DeadlineExceeded(RequestError):
    code = ErrorCode.DEADLINE_EXCEEDED


class Overloaded(RequestError):
    """The broker refused the request to protect the deadlines of others.

    Attributes:
        retry_after_s: the broker's hint of when a retry may succeed, if it gave one.
    """

    code = ErrorCode.OVERLOADED

    def __init__(
        self,
        message: str,
        *,
        request_id: int | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message, request_id=request_id)
        self.retry_after_s = retry_after_s


class Unavailable(RequestError):
    code = ErrorCode.UNAVAILABLE


class InternalError(RequestError):
    code = ErrorCode.INTERNAL


class PermissionDenied(RequestError):
    """The broker's CURVE settings do not let this client's key do that (STATS)."""

    code = ErrorCode.PERMISSION_DENIED


class Cancelled(RequestError):
    """The client cancelled the request while it was still waiting at the broker."""

    code = ErrorCode.CANCELLED


_BY_CODE: dict[int, type[RequestError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        UnsupportedVersion,
        NotFound,
        DeadlineExceeded,
        Overloaded,
        Unavailable,
        InternalError,
        PermissionDenied,
        Cancelled,
    )
}


def error_for_code(
    code: int,
    message: str,
    *,
    request_id: int | None = None,
    retry_after_s: float | None = None,
) -> RequestError:
    """Build the exception for a wire error code; unknown codes become InternalError."""
    cls = _BY_CODE.get(code)
    if cls is None:
        return InternalError(f"unknown error code {code}: {message}", request_id=request_id)
    if cls is Overloaded:
        return Overloaded(message, request_id=request_id, retry_after_s=retry_after_s)
    return cls(message, request_id=request_id)
