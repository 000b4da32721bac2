"""A BATCH's frames, encoded straight from the dispatched requests, are those of its
typed message."""

from __future__ import annotations

from carpool.broker.dispatcher import DispatchedBatch, batch_inputs
from carpool.common.protocol import frames as codec
from tests.unit.broker.pending import pending_request


def test_the_frames_of_a_batch_are_those_of_its_typed_message() -> None:
    plain, padded, in_shm = pending_request(1), pending_request(2), pending_request(3)
    padded.shapes = ((3,),)
    in_shm.refs = (("carpool-t", 64, "ab" * 16),)
    in_shm.shm_outputs = True
    requests = [plain, padded, in_shm]
    payloads = [f for r in requests for f in r.payloads]
    inputs = batch_inputs(plain.key)
    for wire in (None, [t.to_wire() for t in inputs]):
        batch = DispatchedBatch(9, "m", inputs, requests, payloads, 0.25, wire)
        frames = batch.to_frames()
        typed = batch.to_message().to_frames()
        assert frames[0] == typed[0]
        assert codec.unpack(frames[1]) == codec.unpack(typed[1])
        assert frames[2:] == typed[2:] == payloads
