"""The broker's unit-test harness: a BrokerCore driven with wire frames and an injected
clock, builders for the frames its peers send, and a decoder for what it sends back.

Its fixture ``broker`` lives in conftest.py beside it. Each message is one loop turn,
ended with ``on_tick`` as the server ends each turn (the batches form there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from carpool.broker.config import BatchingConfig, BrokerConfig
from carpool.broker.core import BrokerCore, Outgoing, Side, ToWorker
from carpool.common.errors import ErrorCode
from carpool.common.protocol import (
    BatchMeta,
    Command,
    FailedMeta,
    ModelSpec,
    Priority,
    Ready,
    ReplyMeta,
    ResultMeta,
    Submit,
    Telemetry,
    TensorMeta,
    decode_from_worker,
    decode_meta,
    encode,
    encode_reply,
    encode_request,
    encode_simple_request,
    header,
    is_simple_form,
    parse_header,
)
from carpool.common.protocol import frames as codec

T0 = 100.0
W1, W2, W3 = b"w1", b"w2", b"w3"
C1, C2, C3 = b"c1", b"c2", b"c3"
F32 = "float32"


def fixed(max_batch: int = 4, max_wait_s: float = 0.01, policy: str = "fixed") -> BatchingConfig:
    """The minibus rule with fixed knobs (FIFO, no shedding, no adaptive size)."""
    return BatchingConfig(max_batch=max_batch, max_wait_s=max_wait_s, policy=policy)


def model_spec(
    name: str = "m",
    max_batch: int = 8,
    inputs: tuple[tuple[str, str, tuple[int, ...]], ...] = (("x", F32, (-1, 4)),),
) -> ModelSpec:
    return ModelSpec(
        name,
        tuple(TensorMeta(n, d, s) for n, d, s in inputs),
        (TensorMeta("y", F32, (-1, 2)),),
        max_batch,
    )


SPEC = model_spec()
# Two inputs, declared in the order (a, b); item dim of `a` is dynamic.
SPEC2 = model_spec("two", 8, (("a", F32, (-1, -1)), ("b", "uint8", (-1, 2))))
# Dynamic item dim: requests of different widths are different keys.
SPEC_DYN = model_spec("dyn", 8, (("x", F32, (-1, -1)),))


def ready_frames(
    *specs: ModelSpec, name: str = "worker", slots: int = 1, heartbeat_ms: int = 1000
) -> list[Any]:
    return encode(Command.READY, Ready(name, slots, specs or (SPEC,), heartbeat_ms).to_wire())


def payload(rid: int, n: int, item: tuple[int, ...] = (4,), dtype: str = F32) -> bytes:
    return np.full((n, *item), rid % 100, dtype=dtype).tobytes()


# --------------------------------------------------------------------------- decoding output


@dataclass
class Msg:
    """One Outgoing, decoded."""

    side: Side
    to: bytes
    command: Command
    meta: dict[str, Any]
    payloads: list[Any]
    frames: list[Any]
    delimited: bool = False
    simple: bool = False

    @property
    def code(self) -> ErrorCode:
        assert self.command is Command.ERROR
        return ErrorCode(self.meta["code"])

    @property
    def rid(self) -> int | None:
        rid: int | None = self.meta.get("id")
        return rid

    @property
    def batch(self) -> BatchMeta:
        assert self.command is Command.BATCH
        return BatchMeta.from_wire(self.meta)


def parse(out: Outgoing) -> Msg:
    # A worker's message through its wire form, as a worker on a socket gets it.
    frames = list(out.message.to_frames() if isinstance(out, ToWorker) else out.frames)
    delimited = False
    if out.side is Side.FRONTEND and len(frames) > 1 and len(frames[0]) == 0:
        delimited, frames = True, frames[1:]
    if out.side is Side.FRONTEND and len(frames) == 1 and is_simple_form(frames[0]):
        obj = codec.unpack(frames[0], max_bytes=codec.MAX_SIMPLE_BYTES)
        assert obj["v"] == 1
        if "error" in obj:
            meta = {"id": obj["id"], **obj["error"]}
            return Msg(out.side, out.identity, Command.ERROR, meta, [], frames, delimited, True)
        return Msg(out.side, out.identity, Command.REPLY, obj, [], frames, delimited, True)
    command = parse_header(frames[0])
    meta = decode_meta(frames[1])
    return Msg(out.side, out.identity, command, meta, frames[2:], frames, delimited)


def only(msgs: list[Msg], command: Command, side: Side | None = None) -> list[Msg]:
    return [m for m in msgs if m.command is command and (side is None or m.side is side)]


def to_clients(msgs: list[Msg]) -> list[Msg]:
    return [m for m in msgs if m.side is Side.FRONTEND]


def batches(msgs: list[Msg]) -> list[Msg]:
    return only(msgs, Command.BATCH, Side.BACKEND)


def ids(msg: Msg) -> list[int]:
    return [i.request_id for i in msg.batch.items]


# --------------------------------------------------------------------------- the harness


@dataclass
class Broker:
    """A BrokerCore plus builders for the messages its peers send."""

    core: BrokerCore
    sent: dict[int, list[Any]] = field(default_factory=dict)  # request id -> payload objects

    @classmethod
    def make(
        cls, max_batch: int = 4, max_wait_s: float = 0.01, policy: str = "fixed", **config: Any
    ) -> Broker:
        config.setdefault("batching", fixed(max_batch, max_wait_s, policy))
        return cls(BrokerCore(BrokerConfig(**config)))

    def _turn(self, now: float, out: list[Outgoing]) -> list[Msg]:
        out = out + self.core.on_tick(now)  # the server ends every loop turn with a tick
        return [parse(o) for o in out]

    def worker(self, now: float, wid: bytes, frames: list[Any]) -> list[Msg]:
        return self._turn(now, self.core.on_worker(now, wid, decode_from_worker(frames)))

    def client(self, now: float, cid: bytes, frames: list[Any]) -> list[Msg]:
        return self._turn(now, self.core.on_client(now, cid, frames))

    def tick(self, now: float) -> list[Msg]:
        return [parse(o) for o in self.core.on_tick(now)]

    def ready(
        self,
        now: float,
        wid: bytes = W1,
        *specs: ModelSpec,
        slots: int = 1,
        heartbeat_ms: int = 1000,
    ) -> list[Msg]:
        name = wid.decode()
        return self.worker(
            now, wid, ready_frames(*specs, name=name, slots=slots, heartbeat_ms=heartbeat_ms)
        )

    def request_frames(
        self,
        rid: int,
        n: int = 1,
        *,
        model: str = "m",
        item: tuple[int, ...] = (4,),
        timeout_ms: int | None = 1000,
        simple: bool = False,
        delimited: bool = False,
        priority: Priority = Priority.INTERACTIVE,
        nonce: bytes | None = None,
    ) -> list[Any]:
        t = TensorMeta("x", F32, (n, *item))
        data = payload(rid, n, item)
        submit = Submit(rid, model, timeout_ms, (t,), priority, client=nonce)
        if simple:
            frames: list[Any] = [encode_simple_request(submit, [data])]
        else:
            frames = encode_request(submit, [data])
        self.sent[rid] = [data]
        return [b"", *frames] if delimited else frames

    def request(self, now: float, rid: int, cid: bytes = C1, n: int = 1, **kw: Any) -> list[Msg]:
        return self.client(now, cid, self.request_frames(rid, n, **kw))

    def heartbeat(self, now: float, wid: bytes, rho: float | None = None) -> list[Msg]:
        meta = {} if rho is None else {"rho": rho}
        return self.worker(now, wid, encode(Command.HEARTBEAT, meta))

    def disconnect(self, now: float, wid: bytes) -> list[Msg]:
        return self.worker(now, wid, encode(Command.DISCONNECT, {"reason": "bye"}))

    def result(
        self,
        now: float,
        batch: Msg,
        *,
        wid: bytes | None = None,
        rho: float = 0.0,
        compute_ms: float = 1.0,
        cpu_ms: float = 0.0,
        telemetry: Telemetry | None = None,
    ) -> tuple[list[Msg], list[list[Any]]]:
        """The worker's RESULT for ``batch``: one reply per request, as tensors.replies does."""
        meta = batch.batch
        replies = []
        for item in meta.items:
            out = np.full((item.samples, 2), item.request_id % 100, dtype=np.float32)
            reply = ReplyMeta(
                item.request_id,
                (TensorMeta("y", F32, (item.samples, 2)),),
                meta.total_samples,
                item.queue_ms,
                1.0,
            )
            replies.append(encode_reply(reply, [out.tobytes()], simple=item.simple))
        counts = tuple(len(r) for r in replies)
        result = ResultMeta(meta.batch_id, rho, compute_ms, counts, None, telemetry, cpu_ms)
        frames = encode(Command.RESULT, result.to_wire(), [f for r in replies for f in r])
        return self.worker(now, wid or batch.to, frames), replies

    def failed(self, now: float, batch: Msg, code: ErrorCode, message: str = "boom") -> list[Msg]:
        failed = FailedMeta(batch.batch.batch_id, code, message, 0.5)
        return self.worker(now, batch.to, encode(Command.FAILED, failed.to_wire()))


#: The payloads of ``raw_request``'s inputs: b (uint8 [1, 2]) and a (float32 [1, 3]).
B_PAYLOAD = b"\x01\x02"
A_PAYLOAD = np.arange(3, dtype=np.float32).tobytes()
#: The key of ``shm_request``'s shared-memory reference.
SHM_KEY = "5e" * 16


def raw_request(rid: Any = 9, **changes: Any) -> list[Any]:
    """A framed REQUEST built by hand, so fields can be wrong in ways Submit cannot be."""
    meta: dict[str, Any] = {
        "id": rid,
        "model": "two",
        "inputs": [
            {"name": "b", "dtype": "uint8", "shape": [1, 2]},
            {"name": "a", "dtype": F32, "shape": [1, 3]},
        ],
        "timeout_ms": 1000,
    }
    payloads = changes.pop("payloads", [B_PAYLOAD, A_PAYLOAD])
    meta.update(changes)
    return [header(Command.REQUEST), codec.pack(meta), *payloads]


def answer(b: Broker, frames: list[Any]) -> list[tuple[Command, Any, Any]]:
    """What the broker answers to ``frames``: (command, id, code) per client message."""
    return [
        (m.command, m.meta.get("id"), m.meta.get("code"))
        for m in b.client(T0, C1, frames)
        if m.side is Side.FRONTEND
    ]


def shm_request(rid: int, offset: int = 64, **changes: Any) -> list[Any]:
    """A REQUEST in input order (b, a), with ``a`` (spec input 0) in shared memory (§5.4)."""
    inputs = [
        {"name": "b", "dtype": "uint8", "shape": [1, 2]},
        {
            "name": "a",
            "dtype": "float32",
            "shape": [1, 3],
            "shm": changes.pop("ref", {"region": "carpool-7-c1", "offset": offset, "key": SHM_KEY}),
        },
    ]
    changes.setdefault("payloads", [B_PAYLOAD, b""])
    return raw_request(rid, inputs=inputs, **changes)
