"""Bad input gets a clear status and changes nothing (raw protobuf against a real daemon)."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from loopback import free_ports

import kvstored
from conftest import start_daemon
from kvstored_client.contract.errors import FailedPrecondition
from kvstored_client.contract.proto import kvstored_pb2 as pb
from kvstored_client.contract.proto import kvstored_pb2_grpc as pb_grpc
from kvstored_client.errors import from_rpc_error


class Raw:
    """A client plus its raw stub and session, for requests the SDK would refuse to send."""

    def __init__(self, socket: str) -> None:
        self.client = kvstored.Client(socket)
        self.stub = self.client._stub
        self.session = self.client._session()
        self.client.save(np.arange(64), np.ones((4, 512), np.uint8))  # fixes 512-byte blocks
        self.ns = self.client._ns(None)[0]

    def state(self) -> dict[str, Any]:
        """The store's figures, its write-back settled first: a block saved up to ``ssd.max_dirty_s``
        ago reaches SSD by itself, and that must not pass for a refused call's doing."""
        try:
            self.client.flush()
        except FailedPrecondition:   # no SSD tier: nothing in the background
            pass
        st = self.client.stats()
        for key in ("uptime_s", "lookups", "lookup_blocks", "hit_blocks", "hit_tokens", "clients"):
            st.pop(key)
        return st

    def expect(self, code: grpc.StatusCode, needle: str, method: Any, request: Any, reason: str = "") -> None:
        before = self.state()
        with pytest.raises(grpc.RpcError) as info:
            method(request, timeout=10)
        assert info.value.code() == code, info.value.details()
        assert needle in info.value.details()
        if reason:
            assert wire_reason(info.value) == (reason, "kvstored"), info.value.details()
        assert self.state() == before, "a refused call changed the store"


def wire_reason(exc: grpc.RpcError) -> tuple[str, str] | None:
    """The (reason, domain) of the ErrorInfo in a failed call's rich status, read as any gRPC
    client would (grpcio-status), not as the SDK does."""
    status = rpc_status.from_call(exc)
    if status is None:
        return None
    info = error_details_pb2.ErrorInfo()
    found = [(info.reason, info.domain) for detail in status.details if detail.Unpack(info)]
    assert len(found) == 1, status
    return found[0]


@pytest.fixture
def raw(daemon) -> Iterator[Raw]:  # type: ignore[no-untyped-def]
    r = Raw(daemon.socket)
    yield r
    r.client.close()


def keys(n: int, start: int = 1000) -> pb.BlockKeys:
    return pb.BlockKeys(hashes=kvstored.block_hashes(np.arange(start, start + 16 * n)))


def test_wrong_payload_size(raw: Raw) -> None:
    raw.expect(grpc.StatusCode.INVALID_ARGUMENT, "512 bytes; got 100", raw.stub.Reserve,
               pb.ReserveRequest(session_id=raw.session, namespace_id=raw.ns, keys=keys(2), block_bytes=100))


def test_sdk_refuses_rows_that_do_not_cover_the_blocks(raw: Raw) -> None:
    before = raw.state()
    with pytest.raises(kvstored.InvalidArgument, match="1 rows for 3 blocks"):
        raw.client.save(np.arange(48), np.ones((1, 512), np.uint8))
    with pytest.raises(kvstored.InvalidArgument, match="512 bytes; got 256"):
        raw.client.save(np.arange(5000, 5048), np.ones((3, 256), np.uint8))
    assert raw.state() == before


def test_unknown_namespace(raw: Raw) -> None:
    raw.expect(grpc.StatusCode.NOT_FOUND, "unknown namespace", raw.stub.Lookup,
               pb.LookupRequest(namespace_id=424242, keys=keys(1)))


def test_partial_tail_is_ignored(raw: Raw) -> None:
    resp = raw.stub.Lookup(pb.LookupRequest(namespace_id=raw.ns, keys=pb.BlockKeys(
        token_ids=list(range(64 + 15)))))
    assert resp.hit_blocks == 4  # 79 tokens = 4 whole blocks + an ignored tail of 15
    resp = raw.stub.Lookup(pb.LookupRequest(namespace_id=raw.ns, keys=pb.BlockKeys(token_ids=list(range(15)))))
    assert resp.hit_blocks == 0


def test_oversized_batch(raw: Raw) -> None:
    raw.expect(grpc.StatusCode.INVALID_ARGUMENT, "max_batch_blocks", raw.stub.Reserve,
               pb.ReserveRequest(session_id=raw.session, namespace_id=raw.ns, block_bytes=512,
                                 keys=pb.BlockKeys(hashes=[bytes(32)] * 16385)))


def test_malformed_hash_and_both_key_kinds(raw: Raw) -> None:
    raw.expect(grpc.StatusCode.INVALID_ARGUMENT, "has 3 bytes", raw.stub.Reserve,
               pb.ReserveRequest(session_id=raw.session, namespace_id=raw.ns, block_bytes=512,
                                 keys=pb.BlockKeys(hashes=[b"abc"])))
    raw.expect(grpc.StatusCode.INVALID_ARGUMENT, "not several", raw.stub.Lookup,
               pb.LookupRequest(namespace_id=raw.ns, keys=pb.BlockKeys(hashes=[bytes(32)], token_ids=[1] * 16)))


def test_packed_hashes_and_block_ids(raw: Raw) -> None:
    """The packed forms the SDK sends: cut at the namespace's digest size, refused when they do
    not divide, mixed with the repeated form, or exceed the batch limit; equal to the repeated form."""
    chain = list(keys(3).hashes)
    raw.expect(grpc.StatusCode.INVALID_ARGUMENT, "not a whole number of 32-byte", raw.stub.Reserve,
               pb.ReserveRequest(session_id=raw.session, namespace_id=raw.ns, block_bytes=512,
                                 keys=pb.BlockKeys(packed_hashes=b"".join(chain) + b"x")))
    raw.expect(grpc.StatusCode.INVALID_ARGUMENT, "not several", raw.stub.Reserve,
               pb.ReserveRequest(session_id=raw.session, namespace_id=raw.ns, block_bytes=512,
                                 keys=pb.BlockKeys(packed_hashes=b"".join(chain), hashes=chain)))
    raw.expect(grpc.StatusCode.INVALID_ARGUMENT, "max_batch_blocks", raw.stub.Reserve,
               pb.ReserveRequest(session_id=raw.session, namespace_id=raw.ns, block_bytes=512,
                                 keys=pb.BlockKeys(packed_hashes=bytes(32) * 16385)))
    buf = kvstored.shm.empty((4, 256), "float16")
    b = raw.client.register_buffers([buf.numpy()], block_dim=0)
    ns = raw.client._ns(b.namespace)[0]
    packed_ids = np.array([0, 1, 2], "<u4").tobytes()
    raw.expect(grpc.StatusCode.INVALID_ARGUMENT, "whole number of uint32s", raw.stub.SaveBlocks,
               pb.SaveBlocksRequest(session_id=raw.session, namespace_id=ns, buffers_id=b.buffers_id,
                                    keys=keys(3), packed_block_ids=packed_ids[:-1]))
    raw.expect(grpc.StatusCode.INVALID_ARGUMENT, "not both", raw.stub.LoadBlocks,
               pb.LoadBlocksRequest(session_id=raw.session, namespace_id=ns, buffers_id=b.buffers_id,
                                    keys=keys(3), packed_block_ids=packed_ids, block_ids=[0, 1, 2]))
    raw.expect(grpc.StatusCode.INVALID_ARGUMENT, "block_ids[1] = 9 out of range", raw.stub.SaveBlocks,
               pb.SaveBlocksRequest(session_id=raw.session, namespace_id=ns, buffers_id=b.buffers_id,
                                    keys=keys(3), packed_block_ids=np.array([0, 9, 2], "<u4").tobytes()))
    # saved in packed form (ids too), found in repeated form: the same chain
    rows = np.arange(3 * 512, dtype=np.uint8).reshape(3, 512) % 251
    buf.numpy().view(np.uint8).reshape(4, 512)[1:] = rows
    saved = raw.stub.SaveBlocks(pb.SaveBlocksRequest(
        session_id=raw.session, namespace_id=ns, buffers_id=b.buffers_id,
        keys=pb.BlockKeys(packed_hashes=b"".join(chain)), packed_block_ids=np.array([1, 2, 3], "<u4").tobytes()))
    assert saved.stored_blocks == 3
    assert raw.stub.Lookup(pb.LookupRequest(namespace_id=ns, keys=pb.BlockKeys(hashes=chain))).hit_blocks == 3
    out = kvstored.shm.empty((4, 256), "float16")
    b2 = raw.client.register_buffers([out.numpy()], block_dim=0, namespace=b.namespace)
    loaded = raw.stub.LoadBlocks(pb.LoadBlocksRequest(session_id=raw.session, namespace_id=ns,
                                                      buffers_id=b2.buffers_id, keys=keys(3), block_ids=[3, 0, 1]))
    assert loaded.loaded_blocks == 3
    got = out.numpy().view(np.uint8).reshape(4, 512)
    assert (got[3] == rows[0]).all() and (got[0] == rows[1]).all() and (got[1] == rows[2]).all()


def test_bad_namespace_spec(raw: Raw) -> None:
    raw.expect(grpc.StatusCode.INVALID_ARGUMENT, "block_size", raw.stub.OpenNamespace,
               pb.OpenNamespaceRequest(spec=pb.NamespaceSpec(model="x", block_size=0, hash_algo="sha256_cbor")))
    raw.expect(grpc.StatusCode.INVALID_ARGUMENT, "hash_algo", raw.stub.OpenNamespace,
               pb.OpenNamespaceRequest(spec=pb.NamespaceSpec(model="x", block_size=16, hash_algo="md5")))


@pytest.mark.parametrize(("tensor", "needle"), [
    (dict(shm_name="../etc/passwd", shape=[4, 16], strides=[16, 1], dtype="float16"), "plain file name"),
    (dict(shm_name="kvstored-no-such-buffer", shape=[4, 16], strides=[16, 1], dtype="float16"), "cannot open"),
    (dict(shm_name="SHM", shape=[4, 16], strides=[16, 1], dtype="complex64"), "unsupported dtype"),
    (dict(shm_name="SHM", shape=[4, 16], strides=[16], dtype="float16"), "differ in length"),
    (dict(shm_name="SHM", shape=[4, 16], strides=[16, 1], dtype="float16", block_dim=2), "block_dim"),
    (dict(shm_name="SHM", shape=[400, 16], strides=[16, 1], dtype="float16"), "extends to byte"),
    (dict(shm_name="SHM", shape=[4, 16], strides=[16, -1], dtype="float16"), "non-negative"),
    (dict(shm_name="SHM", shape=[4, 8], strides=[8, 1], dtype="float16"), "512 bytes; got 16"),
    # (review) blocks sharing bytes were taken: a load into blocks 0 and 1 overwrote one with the other
    (dict(shm_name="SHM", shape=[4, 256], strides=[0, 1], dtype="float16"), "blocks overlap"),
    (dict(shm_name="SHM", shape=[4, 256], strides=[128, 1], dtype="float16"), "blocks overlap"),
    (dict(shm_name="SHM", shape=[2, 4, 128], strides=[128, 64, 1], dtype="float16", block_dim=1), "blocks overlap"),
])
def test_invalid_buffer_descriptors(raw: Raw, tensor: dict[str, Any], needle: str) -> None:
    buf = kvstored.shm.empty((4, 256), "float16")  # 2 KiB file
    if tensor["shm_name"] == "SHM":
        tensor = {**tensor, "shm_name": buf.name}
    raw.expect(grpc.StatusCode.INVALID_ARGUMENT, needle, raw.stub.RegisterBuffers,
               pb.RegisterBuffersRequest(session_id=raw.session, namespace_id=raw.ns,
                                         tensors=[pb.TensorDesc(**tensor)]))


def test_block_ids_out_of_range_and_count_mismatch(raw: Raw) -> None:
    buf = kvstored.shm.empty((4, 256), "float16")
    b = raw.client.register_buffers([buf.numpy()], block_dim=0)
    ns = raw.client._ns(b.namespace)[0]
    raw.expect(grpc.StatusCode.INVALID_ARGUMENT, "out of range", raw.stub.SaveBlocks,
               pb.SaveBlocksRequest(session_id=raw.session, namespace_id=ns, buffers_id=b.buffers_id,
                                    keys=keys(2), block_ids=[0, 9]))
    raw.expect(grpc.StatusCode.INVALID_ARGUMENT, "1 block ids for 2 blocks", raw.stub.LoadBlocks,
               pb.LoadBlocksRequest(session_id=raw.session, namespace_id=ns, buffers_id=b.buffers_id,
                                    keys=keys(2), block_ids=[0]))
    raw.expect(grpc.StatusCode.NOT_FOUND, "unknown buffers", raw.stub.SaveBlocks,
               pb.SaveBlocksRequest(session_id=raw.session, namespace_id=ns, buffers_id=999,
                                    keys=keys(1), block_ids=[0]))


def test_buffers_used_in_another_namespace(raw: Raw) -> None:
    buf = kvstored.shm.empty((4, 256), "float16")
    b = raw.client.register_buffers([buf.numpy()], block_dim=0)
    raw.expect(grpc.StatusCode.INVALID_ARGUMENT, "another namespace", raw.stub.SaveBlocks,
               pb.SaveBlocksRequest(session_id=raw.session, namespace_id=raw.ns, buffers_id=b.buffers_id,
                                    keys=keys(1), block_ids=[0]))


def test_unknown_session_and_reservation(raw: Raw) -> None:
    raw.expect(grpc.StatusCode.FAILED_PRECONDITION, "unknown session", raw.stub.Reserve,
               pb.ReserveRequest(session_id="forged", namespace_id=raw.ns, keys=keys(1), block_bytes=512))
    raw.expect(grpc.StatusCode.NOT_FOUND, "unknown reservation", raw.stub.Seal,
               pb.SealRequest(session_id=raw.session, reservation_id=31337))


def test_calls_after_expiry(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--set", "leases.ttl_s=0.2", "--set", "leases.reservation_ttl_s=0.2",
                       "--set", "leases.reap_interval_s=0.05")
    raw = Raw(d.socket)
    try:
        res = raw.stub.Reserve(pb.ReserveRequest(session_id=raw.session, namespace_id=raw.ns,
                                                 keys=keys(2), block_bytes=512))
        lease = raw.stub.Lookup(pb.LookupRequest(namespace_id=raw.ns, lease=True, session_id=raw.session,
                                                 keys=pb.BlockKeys(hashes=kvstored.block_hashes(np.arange(64)))))
        time.sleep(0.5)
        raw.expect(grpc.StatusCode.FAILED_PRECONDITION, "expired before it was sealed", raw.stub.Seal,
                   pb.SealRequest(session_id=raw.session, reservation_id=res.reservation_id))
        raw.expect(grpc.StatusCode.FAILED_PRECONDITION, "expired before it was released", raw.stub.Release,
                   pb.ReleaseRequest(session_id=raw.session, lease_id=lease.lease_id))
        assert raw.client.lookup(np.arange(1000, 1032)).blocks == 0  # nothing half-written is visible
    finally:
        raw.client.close()


def test_duplicate_block_ids_are_refused(raw: Raw) -> None:
    """Two blocks of one chain cannot come from, or go to, one engine block: SaveBlocks would store
    engine block 0's bytes under block 1's key (a wrong cache entry every later load serves), and
    LoadBlocks would overwrite block 0 with block 1 while reporting both loaded."""
    buf = kvstored.shm.empty((4, 256), "float16")
    b = raw.client.register_buffers([buf.numpy()], block_dim=0)
    ns = raw.client._ns(b.namespace)[0]
    raw.expect(grpc.StatusCode.INVALID_ARGUMENT, "block_ids", raw.stub.SaveBlocks,
               pb.SaveBlocksRequest(session_id=raw.session, namespace_id=ns, buffers_id=b.buffers_id,
                                    keys=keys(2), block_ids=[0, 0]))
    # and a load of a cached chain into one engine block twice
    chain = keys(2, start=3000)
    buf.numpy().view(np.uint8).reshape(4, 512)[:2] = [[1], [2]]
    assert raw.stub.SaveBlocks(pb.SaveBlocksRequest(session_id=raw.session, namespace_id=ns, buffers_id=b.buffers_id,
                                                    keys=chain, block_ids=[0, 1])).stored_blocks == 2
    raw.expect(grpc.StatusCode.INVALID_ARGUMENT, "block_ids", raw.stub.LoadBlocks,
               pb.LoadBlocksRequest(session_id=raw.session, namespace_id=ns, buffers_id=b.buffers_id,
                                    keys=chain, block_ids=[3, 3]))
    assert (buf.numpy().view(np.uint8).reshape(4, 512)[3] == 0).all(), "the refused load copied into block 3"


def test_a_save_refused_for_its_push_target_leaves_no_reservation(raw: Raw) -> None:
    """(review) Seal checks push_to before sealing; when it refused (peers off here, or an unknown
    node) the reservation stayed open until leases.reservation_ttl_s: its blocks were neither
    stored nor given back, and the same save retried without push_to stored nothing for a
    minute (another writer's unsealed blocks: "blocked")."""
    tokens = np.arange(5000, 5000 + 16 * 3)
    kv = np.full((3, 512), 7, np.uint8)
    before = raw.state()
    with pytest.raises(kvstored.FailedPrecondition, match="peers are off"):
        raw.client.save(tokens, kv, push_to="decode-0")
    assert raw.state() == before, "the refused save left something behind"
    assert raw.client.save(tokens, kv).stored == 3
    assert np.array_equal(raw.client.load(tokens).data, kv)


def test_a_seal_refused_for_its_push_target_leaves_a_read_lease_of_that_id_alone(raw: Raw) -> None:
    """(review) A refused Seal gives its reservation back, but it gave back whatever lease had
    the id: a Seal naming one of the session's read leases (a client mixing up its ids) ended
    that lease, unpinning blocks the client was reading, and its Release then failed."""
    chain = pb.BlockKeys(hashes=kvstored.block_hashes(np.arange(64)))
    lease = raw.stub.Lookup(pb.LookupRequest(namespace_id=raw.ns, lease=True, session_id=raw.session, keys=chain),
                            timeout=10)
    assert lease.hit_blocks == 4 and lease.lease_id
    raw.expect(grpc.StatusCode.FAILED_PRECONDITION, "peers are off", raw.stub.Seal,
               pb.SealRequest(session_id=raw.session, reservation_id=lease.lease_id, push_to="decode-0"))
    raw.stub.Release(pb.ReleaseRequest(session_id=raw.session, lease_id=lease.lease_id), timeout=10)


def test_a_status_message_echoing_a_long_field_still_reaches_the_client(raw: Raw) -> None:
    """(review) A refusal's message echoes request fields (a model name) and lists the node's
    models; past the client's metadata limit (16 KiB of percent-encoded grpc-message) the client
    got RESOURCE_EXHAUSTED "received metadata size exceeds hard limit" in place of the status
    sent: an Evict or Flush of an unknown model raised ResourceExhausted, not NotFound, and one
    namespace opened with a long model name did that to every unknown-model refusal after it."""
    for model in ("z" * 20000, "é" * 3000):
        raw.expect(grpc.StatusCode.NOT_FOUND, "no namespace of model", raw.stub.Evict, pb.EvictRequest(model=model))
        raw.expect(grpc.StatusCode.NOT_FOUND, "characters cut", raw.stub.Flush, pb.FlushRequest(model=model))
    raw.stub.OpenNamespace(pb.OpenNamespaceRequest(spec=pb.NamespaceSpec(model="m" * 100000, block_size=16)),
                           timeout=10)
    raw.expect(grpc.StatusCode.NOT_FOUND, "models here", raw.stub.Evict, pb.EvictRequest(model="nope"))
    with pytest.raises(kvstored.NotFound, match="no namespace of model 'nope'"):
        raw.client.evict(model="nope")


def test_an_expired_id_is_told_as_what_it_was_and_only_to_its_own_session(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """(review) The daemon remembered expired ids without their session or kind: a Release of an
    expired reservation said "lease N expired ... (ttl of read leases); bytes read under it may
    be stale", a Seal naming an expired read lease said "reservation N expired before it was
    sealed", and another session's expired id was FAILED_PRECONDITION "expired" (the SDK's
    LeaseExpired) where any other id of another session is NOT_FOUND."""
    d = daemon_factory("--set", "leases.ttl_s=0.2", "--set", "leases.reservation_ttl_s=0.3",
                       "--set", "leases.reap_interval_s=0.05")
    raw, other = Raw(d.socket), Raw(d.socket)
    try:
        res = raw.stub.Reserve(pb.ReserveRequest(session_id=raw.session, namespace_id=raw.ns,
                                                 keys=keys(2), block_bytes=512), timeout=10)
        lease = raw.stub.Lookup(pb.LookupRequest(namespace_id=raw.ns, lease=True, session_id=raw.session,
                                                 keys=pb.BlockKeys(hashes=kvstored.block_hashes(np.arange(64)))),
                                timeout=10)
        assert res.reservation_id and lease.lease_id
        time.sleep(0.8)
        raw.expect(grpc.StatusCode.FAILED_PRECONDITION,
                   f"reservation {res.reservation_id} expired before it was released (ttl 0.3s); nothing was stored",
                   raw.stub.Release,
                   pb.ReleaseRequest(session_id=raw.session, lease_id=res.reservation_id))
        raw.expect(grpc.StatusCode.NOT_FOUND, f"unknown reservation {lease.lease_id}", raw.stub.Seal,
                   pb.SealRequest(session_id=raw.session, reservation_id=lease.lease_id))
        for lease_id in (res.reservation_id, lease.lease_id):
            other.expect(grpc.StatusCode.NOT_FOUND, f"unknown lease {lease_id}", other.stub.Release,
                         pb.ReleaseRequest(session_id=other.session, lease_id=lease_id))
        other.expect(grpc.StatusCode.NOT_FOUND, "unknown reservation", other.stub.Seal,
                     pb.SealRequest(session_id=other.session, reservation_id=res.reservation_id))
        raw.expect(grpc.StatusCode.FAILED_PRECONDITION, "expired before it was released (ttl 0.2s)", raw.stub.Release,
                   pb.ReleaseRequest(session_id=raw.session, lease_id=lease.lease_id))
    finally:
        raw.client.close()
        other.client.close()


def test_a_stream_with_block_ids_but_no_buffers_is_refused(raw: Raw) -> None:
    """(review) StreamBlocks with block_ids and no buffers_id streamed through the arena, the ids
    ignored without a word: a client that left out (or zeroed) buffers_id got no block in its
    engine's buffers while each arrival said the block was in place. LoadBlocks refuses it."""
    chain = pb.BlockKeys(hashes=kvstored.block_hashes(np.arange(64)))
    for request in (pb.StreamBlocksRequest(session_id=raw.session, namespace_id=raw.ns, keys=chain,
                                           block_ids=[0, 1, 2, 3]),
                    pb.StreamBlocksRequest(session_id=raw.session, namespace_id=raw.ns, keys=chain,
                                           packed_block_ids=np.arange(4, dtype="<u4").tobytes())):
        raw.expect(grpc.StatusCode.INVALID_ARGUMENT, "give buffers_id too",
                   lambda r, timeout: list(raw.stub.StreamBlocks(r, timeout=timeout)), request)
    with pytest.raises(kvstored.InvalidArgument, match="give buffers too"):
        raw.client.stream(np.arange(64), block_ids=[0, 1, 2, 3])
    assert [a.index for a in raw.client.stream(np.arange(64))] == [0, 1, 2, 3]   # the arena's way


def test_each_refusal_carries_its_reason_on_the_wire(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """The daemon's status mapping puts a reason code beside the status (google.rpc.ErrorInfo,
    domain "kvstored", in grpc-status-details-bin): what the SDK decides by, and what a raw gRPC
    client can too, whatever the message says."""
    d = daemon_factory("--set", "leases.ttl_s=0.2", "--set", "leases.reservation_ttl_s=0.3",
                       "--set", "leases.reap_interval_s=0.05")
    raw = Raw(d.socket)
    try:
        stub, session, ns = raw.stub, raw.session, raw.ns
        raw.expect(grpc.StatusCode.NOT_FOUND, "unknown namespace", stub.Lookup,
                   pb.LookupRequest(namespace_id=424242, keys=keys(1)), reason="UNKNOWN_NAMESPACE")
        raw.expect(grpc.StatusCode.NOT_FOUND, "unknown lease", stub.Release,
                   pb.ReleaseRequest(session_id=session, lease_id=987654), reason="UNKNOWN_LEASE")
        raw.expect(grpc.StatusCode.NOT_FOUND, "no namespace of model", stub.Evict,
                   pb.EvictRequest(model="nope"), reason="UNKNOWN_MODEL")
        raw.expect(grpc.StatusCode.NOT_FOUND, "unknown buffers", stub.SaveBlocks,
                   pb.SaveBlocksRequest(session_id=session, namespace_id=ns, buffers_id=99, keys=keys(1),
                                        block_ids=[0]), reason="UNKNOWN_BUFFERS")
        raw.expect(grpc.StatusCode.INVALID_ARGUMENT, "not a whole number", stub.Lookup,
                   pb.LookupRequest(namespace_id=ns, keys=pb.BlockKeys(packed_hashes=b"x" * 33)), reason="BAD_KEYS")
        raw.expect(grpc.StatusCode.INVALID_ARGUMENT, "unknown tier", stub.Evict,
                   pb.EvictRequest(tier=99), reason="INVALID_ARGUMENT")
        raw.expect(grpc.StatusCode.FAILED_PRECONDITION, "unknown session", stub.Reserve,
                   pb.ReserveRequest(session_id="gone", namespace_id=ns, keys=keys(1), block_bytes=512),
                   reason="UNKNOWN_SESSION")
        raw.expect(grpc.StatusCode.FAILED_PRECONDITION, "peers are off", stub.Seal,
                   pb.SealRequest(session_id=session, reservation_id=1, push_to="decode-0"), reason="PEERS_OFF")
        res = stub.Reserve(pb.ReserveRequest(session_id=session, namespace_id=ns, keys=keys(2), block_bytes=512),
                           timeout=10)
        lease = stub.Lookup(pb.LookupRequest(namespace_id=ns, lease=True, session_id=session,
                                             keys=pb.BlockKeys(hashes=kvstored.block_hashes(np.arange(64)))),
                            timeout=10)
        time.sleep(0.8)
        raw.expect(grpc.StatusCode.FAILED_PRECONDITION, "expired", stub.Seal,
                   pb.SealRequest(session_id=session, reservation_id=res.reservation_id), reason="RESERVATION_EXPIRED")
        raw.expect(grpc.StatusCode.FAILED_PRECONDITION, "expired", stub.Release,
                   pb.ReleaseRequest(session_id=session, lease_id=lease.lease_id), reason="LEASE_EXPIRED")
        # and the SDK raises what the reason says, with it
        with pytest.raises(kvstored.NotFound) as info:
            raw.client.evict(model="nope")
        assert info.value.reason == "UNKNOWN_MODEL"
    finally:
        raw.client.close()


def test_a_request_that_does_not_parse_is_invalid_argument_counted_and_logged_once(tmp_path: Path) -> None:
    """Bytes that are not the method's message: INVALID_ARGUMENT with reason MALFORMED_REQUEST on
    any method, unary or streamed, raised by the SDK as InvalidArgument; one log line, no
    traceback, every one counted in kvstored_bad_requests_total."""
    (port,) = free_ports(1)
    d = start_daemon(tmp_path, "--set", f"server.metrics=127.0.0.1:{port}")
    try:
        with grpc.insecure_channel(f"unix:{d.socket}") as channel:
            def same(b: bytes) -> bytes:
                return b
            lookup = channel.unary_unary("/kvstored.v1.KVStore/Lookup", request_serializer=same,
                                         response_deserializer=same)
            session = channel.stream_stream("/kvstored.v1.KVStore/Session", request_serializer=same,
                                            response_deserializer=same)
            for _ in range(20):
                with pytest.raises(grpc.RpcError) as info:
                    lookup(b"\xff\xff\xff", timeout=10)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert wire_reason(info.value) == ("MALFORMED_REQUEST", "kvstored")
                assert isinstance(from_rpc_error(info.value), kvstored.InvalidArgument)
            with pytest.raises(grpc.RpcError) as info:
                list(session(iter([b"\x0a\x05ab"]), timeout=10))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert wire_reason(info.value) == ("MALFORMED_REQUEST", "kvstored")
            # refusals raised in a handler, and in a stream's work, are counted as well
            stub = pb_grpc.KVStoreStub(channel)
            with pytest.raises(grpc.RpcError):
                stub.Evict(pb.EvictRequest(tier=99), timeout=10)
            with pytest.raises(grpc.RpcError):
                list(stub.LoadBlocksStream(pb.LoadBlocksRequest(packed_block_ids=b"abc"), timeout=10))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            scraped = resp.read().decode()
        assert 'kvstored_bad_requests_total{kind="invalid_argument",method="Evict"} 1.0' in scraped
        assert 'kvstored_bad_requests_total{kind="invalid_argument",method="LoadBlocksStream"} 1.0' in scraped
        assert 'kvstored_bad_requests_total{kind="malformed_request",method="Lookup"} 20.0' in scraped
        assert 'kvstored_bad_requests_total{kind="malformed_request",method="Session"} 1.0' in scraped
        c = kvstored.Client(d.socket)
        try:
            assert c.stats()["clients"] == 0   # the refused session left nothing open
        finally:
            c.close()
    finally:
        d.stop()
    log = d.log()
    assert "Traceback" not in log and "DecodeError" not in log
    assert log.count("bad request from") == 2   # one per kind: malformed_request, invalid_argument
