"""inputs.py: a request's input tensors as descriptors and payload frames — pure.

Each input becomes its wire descriptor and either its payload frame or, when the client
has a shared-memory region with room and the input is large enough, a place in that
region (protocol §5.4). A payload frame is never the caller's memory: ``submit`` promises
that the caller may refill its buffers as soon as it returns, while a frame may be read
later (a large one is sent without a copy when the socket gets to it, and any one is sent
again from what the client kept after a lost connection, :mod:`carpool.client.resend`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import ArrayLike

from carpool.common.protocol import DTYPES, ref_wire, tensor_wire, wire_dtype
from carpool.common.shm import ShmArena

#: Inputs at least this large are sent without a copy (pyzmq's zmq.COPY_THRESHOLD);
#: the client copies those that are the caller's memory first.
ALIAS_MIN_BYTES = 65536


def encode_inputs(
    inputs: Mapping[str, ArrayLike], arena: ShmArena | None, shm_min_bytes: int
) -> tuple[list[dict[str, Any]], list[Any], list[int]]:
    """The descriptors and payload frames of ``inputs``, in their order, and the offsets
    of the region's space they hold (given back here if an input is refused).

    Raises:
        TypeError: ``inputs`` is not a mapping of names to arrays.
        ValueError: no inputs, or a scalar one.
        ProtocolError: an input's dtype has no wire name.
    """
    if type(inputs) is not dict and not isinstance(inputs, Mapping):
        # (An array's truth value, or a list's missing .items(), said nothing useful.)
        raise TypeError(
            f"inputs must map each input's name to its array, e.g. {{'x': array}}; "
            f"got {type(inputs).__name__}"
        )
    if not inputs:
        raise ValueError("a request needs at least one input tensor")
    metas: list[dict[str, Any]] = []
    payloads: list[Any] = []
    leases: list[int] = []
    try:
        for name, value in inputs.items():
            arr = np.asarray(value)
            if arr.ndim == 0:
                raise ValueError(f"input {name!r} is a scalar; dim 0 is the batch")
            dtype = wire_dtype(arr.dtype)
            given = arr
            arr = np.ascontiguousarray(arr, dtype=DTYPES[dtype])
            desc = tensor_wire(name, dtype, [int(d) for d in arr.shape])
            metas.append(desc)
            if arena is not None and arr.nbytes >= shm_min_bytes:
                offset = arena.put(memoryview(arr.reshape(-1).view(np.uint8)))  # type: ignore[arg-type]
                if offset is not None:  # else no room: this one goes in its frame
                    desc["shm"] = ref_wire((arena.name, offset, arena.key))
                    leases.append(offset)
                    payloads.append(b"")
                    continue
            if isinstance(value, list | tuple):  # (made here: nobody else has it)
                payloads.append(arr)
            elif arr.nbytes >= ALIAS_MIN_BYTES:
                # Sent without a copy, the caller's own buffer would be read when the
                # socket gets to it: a camera loop that refills its frame after submit()
                # would change a request already made.
                payloads.append(arr.copy() if np.may_share_memory(arr, given) else arr)
            else:
                # pyzmq copies a small frame as it sends it, but a request sent again is
                # sent from the frames kept: a copy of the caller's buffer as it was.
                aliased = arr is given or arr.base is not None  # (not a fresh copy)
                payloads.append(arr.tobytes() if aliased else arr)
    except BaseException:
        for offset in leases:  # a later input was bad: give back what was placed
            assert arena is not None
            arena.free(offset)
        raise
    return metas, payloads, leases


class Encoded(NamedTuple):
    """A request encoded (``ClientCore.encode``), not kept yet: its id, model, meta and
    payload frames, shared-memory leases, when it was made and its timeout."""

    rid: int
    model: str
    meta: dict[str, Any]
    payloads: list[Any]
    leases: list[int]
    now: float
    timeout_s: float
