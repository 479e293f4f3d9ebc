"""The fast path's wire format: the hot unary calls in length-prefixed frames on a Unix socket.

A request frame is :data:`REQUEST` (payload length, method id, request id, deadline budget in
seconds, 0 for none) followed by the method's protobuf request, the very message gRPC carries.
An answer frame is :data:`ANSWER` (payload length, the request's id, a gRPC status code) followed
by the response message when the code is OK, else by the ``google.rpc.Status`` the daemon sends
in gRPC's ``grpc-status-details-bin`` (code, message and the reason's ``ErrorInfo``), so the SDK
maps a failure to the same error on both transports. Answers may come in any order (the request
id pairs them); a frame longer than :data:`MAX_PAYLOAD_BYTES` or of an unknown shape ends the
connection. A request whose method id carries :data:`ONE_WAY` is served the same but never
answered, whatever its outcome (the SDK's lookups answered from the presence table tell the daemon
of their hits so). Streaming calls, the session and everything else stay on gRPC.
"""

from __future__ import annotations

import struct

from google.protobuf.message import Message

from kvstored_client.contract.proto import kvstored_pb2 as pb

REQUEST = struct.Struct("<IBQd")   # payload bytes, method id, request id, budget (s; 0: no deadline)
ANSWER = struct.Struct("<IQB")     # payload bytes, request id, gRPC status code (0: OK)
MAX_PAYLOAD_BYTES = 64 << 20       # the gRPC listener's message limit
OK = 0
ONE_WAY = 0x80                     # in a request's method id: serve it, answer nothing

# Method id -> (name, request type, response type); ids are stable: append, never reorder.
METHODS: dict[int, tuple[str, type[Message], type[Message]]] = {
    1: ("Lookup", pb.LookupRequest, pb.LookupResponse),
    2: ("Reserve", pb.ReserveRequest, pb.ReserveResponse),
    3: ("Seal", pb.SealRequest, pb.SealResponse),
    4: ("Release", pb.ReleaseRequest, pb.ReleaseResponse),
    5: ("Prefetch", pb.PrefetchRequest, pb.PrefetchResponse),
    6: ("SaveBlocks", pb.SaveBlocksRequest, pb.SaveBlocksResponse),
    7: ("LoadBlocks", pb.LoadBlocksRequest, pb.LoadBlocksResponse),
    8: ("Stats", pb.StatsRequest, pb.StatsResponse),
    9: ("Commit", pb.CommitRequest, pb.CommitResponse),
}
METHOD_IDS = {name: method_id for method_id, (name, _, _) in METHODS.items()}


def one_way_frame(method: str, request: Message) -> bytes:
    """``request`` to ``method`` as a one-way frame (no request id, no deadline: never answered)."""
    body = request.SerializeToString()
    return REQUEST.pack(len(body), METHOD_IDS[method] | ONE_WAY, 0, 0.0) + body


def fast_socket_path(grpc_socket: str) -> str:
    """Where a daemon serving gRPC on ``grpc_socket`` puts its fast socket: the same directory
    (so the same permission rules), ``NAME.sock`` -> ``NAME.fast.sock``."""
    base = grpc_socket[: -len(".sock")] if grpc_socket.endswith(".sock") else grpc_socket
    return f"{base}.fast.sock"
