"""request_decoder.py: RequestDecoder — REQUEST metas decoded, fast for layouts seen before.

The full decoder is :func:`~carpool.common.protocol.client_messages.decode_submit`: every
field checked, every descriptor built into a :class:`TensorMeta`. A broker sees the same
few request layouts (model, input names, dtypes, shapes) again and again; once one passed
the full decoder and its user's own checks, the user :meth:`~RequestDecoder.remember`\\ s
it with a value of its own (the broker's queue key and sample count), and a later request
with that layout is decoded with the same checks on the raw map and its frames, without
building metas. Anything unusual goes to the full decoder, so its error messages are the
only ones a client sees. Pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from carpool.common.errors import ProtocolError
from carpool.common.protocol.client_messages import (
    CLIENT_NONCE_BYTES,
    Submit,
    decode_submit,
    request_id_of,
)
from carpool.common.protocol.frames import MAX_TIMEOUT_MS, PRIORITIES, Frame, Priority
from carpool.common.protocol.refs import MAX_REF_BYTES, ShmRef, shm_refs
from carpool.common.protocol.tensors import Signature, tensor_signature

L = TypeVar("L")


@dataclass(slots=True)
class KnownRequest(Generic[L]):
    """A valid REQUEST of a remembered layout. (Not frozen: one per request.)"""

    layout: L  # what the user remembered with the layout
    request_id: int
    timeout_ms: int | None
    priority: Priority
    # Per input, in the request's order: its shared-memory reference or None (§5.4).
    refs: tuple[ShmRef | None, ...] | None
    shm_outputs: bool
    client: bytes | None  # the client's nonce (§6.1)


class RequestDecoder(Generic[L]):
    """Decodes REQUEST metas; remembers up to ``max_layouts`` validated layouts (all
    forgotten at once when full: clients choose shapes)."""

    def __init__(self, max_layouts: int = 1024) -> None:
        self.max_layouts = max_layouts
        # (model, signature) -> (the user's value, each payload frame's length)
        self.layouts: dict[tuple[str, Signature], tuple[L, tuple[int, ...]]] = {}

    def remember(self, submit: Submit, value: L) -> None:
        """Remember the layout of ``submit`` (which passed the full decoder and its
        user's checks) with the user's ``value``."""
        if len(self.layouts) >= self.max_layouts:
            self.layouts.clear()
        key = (submit.model, tuple((t.name, t.dtype, t.shape) for t in submit.inputs))
        self.layouts[key] = (value, tuple(t.nbytes for t in submit.inputs))

    def forget_model(self, model: str) -> None:
        """Forget the layouts of ``model`` (its spec changed)."""
        for key in [key for key in self.layouts if key[0] == model]:
            del self.layouts[key]

    def decode(self, meta: dict[str, Any], payloads: Sequence[Frame]) -> KnownRequest[L] | Submit:
        """A request of a remembered layout that passes every check the full decoder
        (and the user's checks of the layout) would make, checked on its raw map and
        frames; anything else, the full decoder's :class:`Submit`.

        Raises:
            ProtocolError: the request is not valid (the full decoder's message).
        """
        model = meta.get("model")
        inputs = tensor_signature(meta.get("inputs"))
        if type(model) is not str or inputs is None:
            return decode_submit(meta)
        entry = self.layouts.get((model, inputs))
        if entry is None:
            return decode_submit(meta)
        layout, sizes = entry
        if len(payloads) != len(sizes):
            return decode_submit(meta)
        refs = None
        descriptors = meta["inputs"]  # a list of maps: tensor_signature checked
        for t in descriptors:
            if "shm" in t:
                try:
                    refs = shm_refs(descriptors)
                except ProtocolError:
                    return decode_submit(meta)  # which says what is wrong
                break
        if refs is None:
            for frame, size in zip(payloads, sizes, strict=True):
                if len(frame) != size:
                    return decode_submit(meta)
        else:
            for frame, size, ref in zip(payloads, sizes, refs, strict=True):
                if len(frame) != (size if ref is None else 0) or size > MAX_REF_BYTES:
                    return decode_submit(meta)  # (a claim that large: the frame checks refuse it)
        rid = request_id_of(meta)
        timeout = meta.get("timeout_ms")
        prio = meta.get("priority", 0)
        shm_outputs = meta.get("shm_outputs", False)
        nonce = meta.get("client")
        if (
            rid is None
            or type(shm_outputs) is not bool
            or (
                nonce is not None and (type(nonce) is not bytes or len(nonce) != CLIENT_NONCE_BYTES)
            )
            or (
                timeout is not None
                and (type(timeout) is not int or not 0 < timeout <= MAX_TIMEOUT_MS)
            )
            or type(prio) is not int
            or prio not in (0, 1)
        ):
            return decode_submit(meta)
        return KnownRequest(layout, rid, timeout, PRIORITIES[prio], refs, shm_outputs, nonce)
