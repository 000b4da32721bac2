"""codec.py: msgpack with safe limits, and the tensor dtype allow-list.

Rules: this is the only module that imports msgpack. It never uses pickle or ext types,
always packs with ``use_bin_type=True`` and unpacks with ``raw=False`` and
``strict_map_key=True``, and keeps every size limit on. Pure: no I/O.
"""

from __future__ import annotations

from _thread import _local as thread_local  # threading.local, without the threading module
from typing import Any

import msgpack
import numpy as np

from carpool.common.errors import ProtocolError

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


def unpack(data: bytes | memoryview, *, max_bytes: int = MAX_META_BYTES) -> Any:
    """Decode one msgpack object, refusing anything larger than ``max_bytes``.

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
            use_list=True,
            max_bin_len=max_bytes,
            max_str_len=max_bytes,
            max_array_len=max_bytes,
            max_map_len=max_bytes,
            max_ext_len=0,  # (bounds an extension's body, but lets an empty one by)
            ext_hook=_no_ext,
        )
    except Exception as exc:  # msgpack raises a zoo of types on bad input
        raise ProtocolError(f"malformed msgpack: {exc}") from None
