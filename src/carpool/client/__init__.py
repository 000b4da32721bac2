"""The client SDK: :class:`Client` (blocking) and :class:`AsyncClient` (asyncio).

Both speak to a broker's frontend and raise the typed errors of
:mod:`carpool.common.errors`::

    from carpool.client import Client

    with Client("tcp://127.0.0.1:5555") as client:
        outputs = client.infer("orientation", {"x": batch}, timeout_s=0.5)
"""

from carpool.client.aio import AsyncClient
from carpool.client.calls import ReplyFuture
from carpool.client.options import ClientOptionArgs, ClientOptions
from carpool.client.results import InferResult
from carpool.client.sync import Client
from carpool.common.errors import (
    Cancelled,
    CarpoolError,
    DeadlineExceeded,
    InternalError,
    InvalidArgument,
    NotFound,
    Overloaded,
    PermissionDenied,
    ProtocolError,
    RequestError,
    Unavailable,
    UnsupportedVersion,
)
from carpool.common.protocol import ModelMetadata, Priority

__all__ = [
    "AsyncClient",
    "Cancelled",
    "CarpoolError",
    "Client",
    "ClientOptionArgs",
    "ClientOptions",
    "DeadlineExceeded",
    "InferResult",
    "InternalError",
    "InvalidArgument",
    "ModelMetadata",
    "NotFound",
    "Overloaded",
    "PermissionDenied",
    "Priority",
    "ProtocolError",
    "ReplyFuture",
    "RequestError",
    "Unavailable",
    "UnsupportedVersion",
]
