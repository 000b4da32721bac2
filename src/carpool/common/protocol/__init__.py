"""carpool.common.protocol: carpool wire protocol v1 — frame layout, commands, messages.

Rules: pure. No sockets, no clock, no logging. Decoders validate everything that came off
the network and raise :class:`ProtocolError` (never ``assert``). docs/protocol.md is the
normative description; this docstring is the summary.

Every message (after the ROUTER's routing-id frame, which only the broker sees) is::

    frame 0   header   4 bytes: b"C" b"P" <version:u8> <command:u8>
    frame 1   meta     msgpack map (at most 64 KiB)
    frame 2.. tensors  raw little-endian C-order bytes, one frame per tensor, in meta order

Client ↔ broker (client DEALER or REQ → broker frontend ROUTER)::

    REQUEST  C→B  meta {id, model, timeout_ms?, inputs: [{name, dtype, shape}], priority?,
                        client?}
    REPLY    B→C  meta {id, outputs: [{name, dtype, shape}], batch_size, queue_ms, compute_ms}
    ERROR    B→C  meta {id, code, message, retry_after_ms?, retry?}        (no tensor frames)
    STATS    C→B  meta {id?}       B→C meta {broker counters, id?}
    CANCEL   C→B  meta {id, client}                                        (never answered)
    METADATA C→B  meta {id?, model?}   B→C meta {id, models: [{model spec, workers}]}

    The simple form: one msgpack frame (a map, so its first byte is never b"C"):
    {v: 1, id, model, timeout_ms, inputs: [{name, dtype, shape, data: bin}]}; the reply comes
    back in the same form: {v: 1, id, outputs: [{..., data}]} or {v: 1, id, error: {...}}.

Worker ↔ broker (worker DEALER → broker backend ROUTER)::

    READY      W→B  meta {name, slots, heartbeat_ms,
                          models: [{name, inputs, outputs, max_batch, preferred_batch}]}
    HEARTBEAT  W↔B  meta {rho?}
    BATCH      B→W  meta {batch, model, inputs: [{name, dtype, shape: [-1, ...]}],
                          requests: [{id, n, simple, queue_ms}]}
                    frames: request-major, one frame per (request, input)
    RESULT     W→B  meta {batch, rho, compute_ms, frames: [k_i]} then, per request, the k_i
                    frames of the finished client reply (REPLY or ERROR, or one simple frame)
    FAILED     W→B  meta {batch, code, message, rho}
    DISCONNECT W↔B  meta {reason}

Modules: :mod:`.frames` (header, commands, limits, meta maps, tensor descriptors and
frame sizes), :mod:`.refs` (shared-memory references),
:mod:`.client_messages` (REQUEST, REPLY, ERROR, CANCEL: their encoders, and the simple
form's), :mod:`.ready` (READY and its model specs), :mod:`.metadata` (METADATA),
:mod:`.worker_messages` (BATCH, and the broker's messages to a worker as one typed
union), :mod:`.from_client` and :mod:`.from_worker` (each side's messages to the broker
as one typed union, RESULT's and FAILED's metas with the worker's; the client's
decoder holds REQUEST's one validator and its layout cache). Each message has one encoder
(``<message>_wire`` builds its meta map from its fields, ``<message>_frames`` its frames;
a dataclass's ``to_wire`` calls the former) and one decoder, used by every caller. The
package imports nothing that does I/O (no sockets, files, locks or threads); a test
holds it to that.
"""

from carpool.common.protocol.client_messages import (
    CLIENT_NONCE_BYTES,
    Cancel,
    ErrorReply,
    ReplyMeta,
    Submit,
    encode_error,
    encode_reply,
    encode_request,
    encode_simple_request,
    reply_frames,
    reply_wire,
    request_frames,
    request_id_of,
    request_wire,
)
from carpool.common.protocol.frames import (
    DTYPES,
    HEADER_BYTES,
    ITEMSIZE,
    MAGIC,
    MAX_EMPTY_SPAN_BYTES,
    MAX_META_BYTES,
    MAX_MODELS,
    MAX_NAME_CHARS,
    MAX_RANK,
    MAX_SIMPLE_BYTES,
    MAX_TENSORS,
    MAX_TIMEOUT_MS,
    PRIORITIES,
    PROTOCOL_VERSION,
    Command,
    Frame,
    Priority,
    Signature,
    TensorMeta,
    VersionMismatch,
    check_frame_sizes,
    decode_meta,
    empty_span_bytes,
    encode,
    header,
    is_simple_form,
    numpy_dtype,
    pack,
    parse_header,
    tensor_signature,
    tensor_wire,
    unpack,
    view,
    wire_dtype,
)
from carpool.common.protocol.from_client import (
    ClientMalformed,
    FromClient,
    KnownLayouts,
    Request,
    StatsQuery,
    decode_from_client,
    decode_request,
    decode_simple,
    decode_simple_request,
    decode_submit,
)
from carpool.common.protocol.from_worker import (
    FailedMeta,
    FromWorker,
    ResultMeta,
    ToBroker,
    WorkerDisconnect,
    WorkerFailed,
    WorkerHeartbeat,
    WorkerMalformed,
    WorkerReady,
    WorkerResult,
    checked_from_worker,
    decode_from_worker,
    result_frames,
    result_wire,
)
from carpool.common.protocol.metadata import (
    MetadataRequest,
    ModelMetadata,
    WorkerLimits,
    metadata_reply_frames,
    parse_metadata_reply,
)
from carpool.common.protocol.ready import ModelSpec, Ready
from carpool.common.protocol.refs import (
    MAX_REF_BYTES,
    OutputRef,
    ShmRef,
    output_ref_wire,
    parse_batch_refs,
    parse_output_ref,
    parse_ref,
    ref_wire,
    shm_refs,
    shm_wire,
    valid_region,
)
from carpool.common.protocol.telemetry import Telemetry
from carpool.common.protocol.worker_messages import (
    HEARTBEAT_TO_WORKER,
    BatchInputCache,
    BatchItem,
    BatchMeta,
    BrokerBatch,
    BrokerDisconnect,
    BrokerHeartbeat,
    BrokerMalformed,
    FromBroker,
    decode_from_broker,
)

__all__ = [
    "CLIENT_NONCE_BYTES",
    "DTYPES",
    "HEADER_BYTES",
    "HEARTBEAT_TO_WORKER",
    "ITEMSIZE",
    "MAGIC",
    "MAX_EMPTY_SPAN_BYTES",
    "MAX_META_BYTES",
    "MAX_MODELS",
    "MAX_NAME_CHARS",
    "MAX_RANK",
    "MAX_REF_BYTES",
    "MAX_SIMPLE_BYTES",
    "MAX_TENSORS",
    "MAX_TIMEOUT_MS",
    "PRIORITIES",
    "PROTOCOL_VERSION",
    "BatchInputCache",
    "BatchItem",
    "BatchMeta",
    "BrokerBatch",
    "BrokerDisconnect",
    "BrokerHeartbeat",
    "BrokerMalformed",
    "Cancel",
    "ClientMalformed",
    "Command",
    "ErrorReply",
    "FailedMeta",
    "Frame",
    "FromBroker",
    "FromClient",
    "FromWorker",
    "KnownLayouts",
    "MetadataRequest",
    "ModelMetadata",
    "ModelSpec",
    "OutputRef",
    "Priority",
    "Ready",
    "ReplyMeta",
    "Request",
    "ResultMeta",
    "ShmRef",
    "Signature",
    "StatsQuery",
    "Submit",
    "Telemetry",
    "TensorMeta",
    "ToBroker",
    "VersionMismatch",
    "WorkerDisconnect",
    "WorkerFailed",
    "WorkerHeartbeat",
    "WorkerLimits",
    "WorkerMalformed",
    "WorkerReady",
    "WorkerResult",
    "check_frame_sizes",
    "checked_from_worker",
    "decode_from_broker",
    "decode_from_client",
    "decode_from_worker",
    "decode_meta",
    "decode_request",
    "decode_simple",
    "decode_simple_request",
    "decode_submit",
    "empty_span_bytes",
    "encode",
    "encode_error",
    "encode_reply",
    "encode_request",
    "encode_simple_request",
    "header",
    "is_simple_form",
    "metadata_reply_frames",
    "numpy_dtype",
    "output_ref_wire",
    "pack",
    "parse_batch_refs",
    "parse_header",
    "parse_metadata_reply",
    "parse_output_ref",
    "parse_ref",
    "ref_wire",
    "reply_frames",
    "reply_wire",
    "request_frames",
    "request_id_of",
    "request_wire",
    "result_frames",
    "result_wire",
    "shm_refs",
    "shm_wire",
    "tensor_signature",
    "tensor_wire",
    "unpack",
    "valid_region",
    "view",
    "wire_dtype",
]
