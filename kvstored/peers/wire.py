"""The peer block channel's wire format: message layouts and codes, request encoding, checksums, limits.

Wire format (all integers big-endian; one connection carries any number of requests, one at a time):

* ``HELLO`` client -> server: ``magic "KVPB", version, flags, token length`` then the token (may be
  empty). ``WELCOME`` server -> client: ``magic, version, status, message length`` then a UTF-8
  message; any status but OK is followed by the server closing the connection. HELLO flag BIND:
  the client binds frame checksums (below); a server that does too answers version 2 (BOUND), and
  the connection binds them both ways. A node that predates binding ignores the flag and answers
  version 1: its connections check payloads only, so old and new nodes still talk.
* ``REQUEST`` client -> server: ``op, flags, 0, key count, namespace id, body bytes`` then the body:
  each key as ``u8 length ‖ key`` (FETCH, PUSH, LOOKUP), or the namespace's description (NAMESPACE).
  PUSH with flag PARENT: the first key names the parent of the pushed chain and has no frame.
  LOOKUP and NAMESPACE are answered with one ACK frame (LOOKUP: ``index`` = how many leading keys
  the peer holds) or an ERROR frame.
* ``FRAME`` either way: ``kind, key length, 0, index, length, checksum`` then the key, then
  ``length`` payload bytes. Kinds: BLOCK (payload = the block), MISSING (the sender does not have
  ``keys[index]``; the transfer ends), END (all blocks sent), ERROR (payload = a UTF-8 message; the
  transfer ends), ACK (push: ``index`` = blocks the receiver stored). A BLOCK's checksum is its
  payload's xxh3-64; on a bound connection, the xxh3-64 of ``namespace id ‖ that ‖ key``
  (:func:`bound_checksum`), so that a request whose namespace id or key was damaged on the way is
  not answered with a block (of another namespace, or another key) that passes its check.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

MAGIC = b"KVPB"
VERSION = 1
BOUND = 2            # WELCOME's version when the connection binds frame checksums

HELLO = struct.Struct(">4sBBH")     # magic, version, flags, token length; then the token
WELCOME = struct.Struct(">4sBBH")   # magic, version, status, message length; then the message
REQUEST = struct.Struct(">BBHIQI")  # op, flags, 0, key count, namespace id, body bytes; then the body
FRAME = struct.Struct(">BBHIQQ")    # kind, key length, 0, index, length, checksum; then key, payload
BIND = struct.Struct(">QQ")         # namespace id, payload checksum; then the key (bound_checksum)

OP_FETCH = 1
OP_PUSH = 2
OP_LOOKUP = 3
OP_NAMESPACE = 4

FLAG_PARENT = 1          # PUSH: keys[0] is the parent of the pushed chain, not a pushed block
FLAG_FIXED = 2           # the body is one length byte, then the keys back to back (all that long)
HELLO_BIND = 1           # HELLO: this client binds frame checksums to their namespace id and key
MAX_NAMESPACE_BYTES = 64 << 10
MAX_TOKEN_BYTES = (1 << 16) - 1   # HELLO's token length field

BLOCK = 1
MISSING = 2
END = 3
ERROR = 4
ACK = 5

WELCOME_OK = 0
WELCOME_AUTH_REQUIRED = 1
WELCOME_AUTH_REJECTED = 2
WELCOME_BAD_VERSION = 3


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds on what a peer may ask for or send; anything beyond is a protocol error."""

    max_keys: int = 1 << 16
    max_key_bytes: int = 255
    max_block_bytes: int = 1 << 30
    handshake_timeout_s: float = 10.0
    # A listener gives up a fetch or push it serves after this long (0 = never): a peer that stops
    # reading (stuck process, zero window) must not keep the blocks it asked for pinned for ever.
    transfer_timeout_s: float = 0.0
    socket_buffer_bytes: int = 0    # SO_SNDBUF/SO_RCVBUF; 0 = leave the kernel's autotuning on


def checksum(data: memoryview | bytes) -> int:
    """A payload's xxh3-64: a BLOCK frame's checksum on a connection that does not bind them."""
    return xxhash.xxh3_64_intdigest(data)


def bound_checksum(payload_checksum: int, namespace_id: int, key: bytes) -> int:
    """A BLOCK frame's checksum on a bound connection: the payload's xxh3-64 bound to the namespace
    id and key it is sent under. One small hash per block on top of the payload's (which a store
    may have computed once for all its peers)."""
    return xxhash.xxh3_64_intdigest(BIND.pack(namespace_id, payload_checksum) + key)


def as_bytes_view(buf: memoryview) -> memoryview:
    """``buf`` as a flat view of bytes, as a payload is framed and checksummed (any format or shape)."""
    view = memoryview(buf)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def encode_frame(kind: int, key: bytes = b"", index: int = 0, length: int = 0, check: int = 0) -> bytes:
    """A FRAME header and its key; the ``length`` payload bytes, if any, are written after it."""
    return FRAME.pack(kind, len(key), 0, index, length, check) + key


def encode_request(op: int, namespace_id: int, keys: Sequence[bytes], limits: Limits, flags: int = 0) -> bytes:
    """A REQUEST and its key list (FLAG_FIXED when the keys are all one length). ValueError for more
    keys than ``limits`` allows, or a key of 0 or more than ``limits.max_key_bytes`` bytes."""
    if len(keys) > limits.max_keys:
        raise ValueError(f"{len(keys)} keys in one request; at most {limits.max_keys}")
    sizes = set(map(len, keys))
    if len(sizes) == 1:   # the usual case (one hash algorithm): no Python loop over the keys
        size = sizes.pop()
        if not 0 < size <= limits.max_key_bytes:
            raise ValueError(f"a key must be 1..{limits.max_key_bytes} bytes, got {size}")
        body_bytes = 1 + size * len(keys)
        return REQUEST.pack(op, flags | FLAG_FIXED, 0, len(keys), namespace_id, body_bytes) + bytes([size]) \
            + b"".join(keys)
    body = bytearray()
    for key in keys:
        if not 0 < len(key) <= limits.max_key_bytes:
            raise ValueError(f"a key must be 1..{limits.max_key_bytes} bytes, got {len(key)}")
        body.append(len(key))
        body += key
    return REQUEST.pack(op, flags, 0, len(keys), namespace_id, len(body)) + bytes(body)


def decode_keys(body: bytes, count: int, flags: int = 0) -> list[bytes]:
    """The keys of a REQUEST's body; ValueError unless it holds exactly ``count`` well-formed keys."""
    if flags & FLAG_FIXED:
        if not body or body[0] == 0 or len(body) != 1 + body[0] * count:
            raise ValueError("malformed fixed-size key list")
        size = body[0]
        return [body[i: i + size] for i in range(1, len(body), size)]
    keys, pos = [], 0
    for _ in range(count):
        if pos >= len(body):
            raise ValueError("key list shorter than its count")
        n = body[pos]
        key = body[pos + 1:pos + 1 + n]
        if n == 0 or len(key) != n:
            raise ValueError("malformed key list")
        keys.append(key)
        pos += 1 + n
    if pos != len(body):
        raise ValueError("key list longer than its count")
    return keys
