"""errors.py: the exception tree and the wire-code mapping."""

from __future__ import annotations

import pytest

from carpool.common.errors import (
    Cancelled,
    CarpoolError,
    ConfigError,
    DeadlineExceeded,
    ErrorCode,
    InternalError,
    InvalidArgument,
    NotFound,
    Overloaded,
    PermissionDenied,
    ProtocolError,
    RequestError,
    Unavailable,
    UnsupportedVersion,
    error_for_code,
)

BY_CODE = {
    ErrorCode.INVALID_ARGUMENT: InvalidArgument,
    ErrorCode.NOT_FOUND: NotFound,
    ErrorCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    ErrorCode.OVERLOADED: Overloaded,
    ErrorCode.UNAVAILABLE: Unavailable,
    ErrorCode.INTERNAL: InternalError,
    ErrorCode.UNSUPPORTED_VERSION: UnsupportedVersion,
    ErrorCode.PERMISSION_DENIED: PermissionDenied,
    ErrorCode.CANCELLED: Cancelled,
}


def test_every_code_has_a_class() -> None:
    assert set(BY_CODE) == set(ErrorCode)


def test_wire_values_never_change() -> None:
    assert {c.name: int(c) for c in ErrorCode} == {
        "INVALID_ARGUMENT": 1,
        "NOT_FOUND": 2,
        "DEADLINE_EXCEEDED": 3,
        "OVERLOADED": 4,
        "UNAVAILABLE": 5,
        "INTERNAL": 6,
        "UNSUPPORTED_VERSION": 7,
        "PERMISSION_DENIED": 8,
        "CANCELLED": 9,
    }


@pytest.mark.parametrize(("code", "cls"), list(BY_CODE.items()), ids=lambda v: str(v))
def test_error_for_code_maps_to_class(code: ErrorCode, cls: type[RequestError]) -> None:
    exc = error_for_code(int(code), "boom", request_id=42)
    assert type(exc) is cls
    assert exc.code == code
    assert exc.message == "boom"
    assert str(exc) == "boom"
    assert exc.request_id == 42
    assert isinstance(exc, RequestError)
    assert isinstance(exc, CarpoolError)


@pytest.mark.parametrize("code", [0, 10, 99, -1, 2**40])
def test_unknown_code_becomes_internal_error(code: int) -> None:
    exc = error_for_code(code, "what", request_id=3)
    assert type(exc) is InternalError
    assert exc.code is ErrorCode.INTERNAL
    assert str(code) in exc.message
    assert "what" in exc.message
    assert exc.request_id == 3


def test_overloaded_carries_retry_after() -> None:
    exc = error_for_code(int(ErrorCode.OVERLOADED), "full", retry_after_s=0.25)
    assert isinstance(exc, Overloaded)
    assert exc.retry_after_s == 0.25
    assert exc.request_id is None
    assert error_for_code(int(ErrorCode.OVERLOADED), "full").retry_after_s is None  # type: ignore[attr-defined]


def test_retry_after_is_ignored_for_other_codes() -> None:
    exc = error_for_code(int(ErrorCode.UNAVAILABLE), "gone", retry_after_s=1.0)
    assert type(exc) is Unavailable
    assert not hasattr(exc, "retry_after_s")


def test_hierarchy() -> None:
    assert issubclass(UnsupportedVersion, InvalidArgument)
    assert issubclass(ProtocolError, CarpoolError)
    assert issubclass(ConfigError, CarpoolError)
    assert not issubclass(ProtocolError, RequestError)
    assert RequestError("x").code is ErrorCode.INTERNAL
