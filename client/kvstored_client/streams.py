"""Calls in progress that the caller consumes as they go: a load into engine buffers reported layer
by layer (:class:`LoadHandle`), and a prompt's blocks streamed one by one (:class:`BlockStream`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np

from kvstored_client.connection import Connection
from kvstored_client.contract.errors import DeadlineExceeded, InvalidArgument, KVStoreError, LeaseExpired
from kvstored_client.contract.proto import kvstored_pb2 as pb
from kvstored_client.errors import from_rpc_error
from kvstored_client.results import TIER_NAMES, BlockArrival, LookupResult, StreamOutcome, loaded


class LoadHandle:
    """A load in progress (``load_blocks(wait=False)``): the daemon reports each tensor (layer) as
    it completes. Raises the load's error from ``wait``/``wait_layer``/``result``, and
    DeadlineExceeded (a TimeoutError) when a wait's ``timeout`` passes first."""

    def __init__(self, stream: Any, block_size: int, num_tensors: int = 0,
                 error: Callable[[grpc.RpcError], KVStoreError] = from_rpc_error) -> None:
        self._stream = stream
        self._block_size = block_size
        self._num_tensors = num_tensors
        self._to_error = error
        self._cond = threading.Condition()
        self._layers: set[int] = set()
        self._result: LookupResult | None = None
        self._done = False
        self._error: KVStoreError | None = None
        threading.Thread(target=self._consume, daemon=True, name="kvstored-load").start()

    def _consume(self) -> None:
        try:
            for event in self._stream:
                kind = event.WhichOneof("event")
                with self._cond:
                    if kind == "started":
                        self._result = loaded(event.started, self._block_size)
                    elif kind == "tensor_done":
                        self._layers.add(event.tensor_done)
                    elif kind == "done":
                        self._done = True
                    self._cond.notify_all()
        except grpc.RpcError as exc:
            with self._cond:
                self._error = self._to_error(exc)
                self._cond.notify_all()
        with self._cond:
            self._done = True
            self._cond.notify_all()

    def _wait_for(self, ready: Callable[[], bool], timeout: float | None) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: ready() or self._error is not None or self._done, timeout):
                # a KVStoreError like every SDK failure, and still the TimeoutError it always was
                raise DeadlineExceeded(f"the load is still in progress after {timeout:g} s (the wait's timeout)")
            if self._error is not None:
                raise self._error
            if not ready():
                raise KVStoreError("the load ended early")

    def wait_layer(self, index: int, timeout: float | None = None) -> None:
        """Block until registered tensor ``index`` holds every loaded block; InvalidArgument for
        an index that is not one of the registered tensors."""
        if self._num_tensors and not 0 <= index < self._num_tensors:
            raise InvalidArgument(f"tensor {index} is not one of the {self._num_tensors} registered tensors")
        self._wait_for(lambda: index in self._layers, timeout)

    def wait(self, timeout: float | None = None) -> LookupResult:
        """Block until every copy is done; returns what was loaded."""
        self._wait_for(lambda: self._done, timeout)
        return self.result()

    def result(self) -> LookupResult:
        """What is being loaded (known as soon as the daemon started copying)."""
        self._wait_for(lambda: self._result is not None, None)
        assert self._result is not None, "no result after waiting for it"
        return self._result


class BlockStream:
    """A streamed load (``Client.stream``): iterate for :class:`BlockArrival` in token order;
    ``outcome`` afterwards. Leaving the loop early (or ``close``) cancels the rest; into engine
    buffers it returns once the daemon has stopped (no copy into them runs or starts after), so
    the engine may reuse the blocks that did not arrive at once."""

    def __init__(self, client: Connection, session_id: str, call: Any, arena: np.ndarray | None, block_size: int,
                 block_bytes: int, started: float, learn_block_bytes: Callable[[], int] | None = None,
                 stream_id: int = 0) -> None:
        self._client = client
        self._started = started   # monotonic, before the call: the lease's clock starts later
        self._session_id = session_id
        self._call = call
        self._arena = arena
        self._block_size = block_size
        self._block_bytes = block_bytes
        # a namespace whose block size was not known when the stream started (another client's
        # first save, or a peer's push, fixed it since): asked again when a block arrives
        self._learn_block_bytes = learn_block_bytes
        self._keep_data = True
        self._stream_id = stream_id   # into buffers: EndStream's id
        self._cancelled = False   # by close()
        self.outcome: StreamOutcome | None = None

    def __iter__(self) -> Iterator[BlockArrival]:
        """Arrivals in token order. In arena mode (no buffers) each block is copied out as the
        loop reaches it (the rest of its event at once when half the lease has passed), under the
        stream's lease; when the copies may have outlived that lease (an engine slower than
        ``leases.ttl_s``), the loop ends with LeaseExpired after the last arrival, as ``load``
        does, instead of leaving bytes that may be another block's."""
        lease_id = 0
        ttl_s = self._client._hello.lease_ttl_ms / 1000
        try:
            for event in self._call:
                lease_id = lease_id or event.lease_id   # told first, so leaving early can release it
                blocks = event.blocks
                if blocks and not self._block_bytes and self._arena is not None and self._keep_data \
                        and self._learn_block_bytes is not None:
                    # else each arrival would carry 0 bytes of its block
                    self._block_bytes = self._learn_block_bytes()
                copied: dict[int, Any] = {}
                for k, b in enumerate(blocks):
                    data = None
                    if self._arena is not None and self._keep_data:
                        if k not in copied and time.monotonic() - self._started >= ttl_s / 2:
                            # The loop dawdles: copy the rest of this event while the lease (ttl
                            # from the lookup, after the call started) surely still holds them.
                            # Before this point every copy is under the lease: block 0 goes out
                            # without waiting for (and holding) the whole event's bytes.
                            for j in range(k, len(blocks)):
                                o = blocks[j].offset
                                copied[j] = self._arena[o: o + self._block_bytes].copy()
                        data = copied.pop(k, None)
                        if data is None:
                            data = self._arena[b.offset: b.offset + self._block_bytes].copy()
                    yield BlockArrival(b.index, TIER_NAMES.get(b.tier, str(b.tier)), b.peer, data)
                if event.HasField("end"):
                    e = event.end
                    lease_id = e.lease_id   # 0 when nothing stayed leased
                    ttl_s = e.lease_ttl_ms / 1000 or ttl_s
                    self.outcome = StreamOutcome(e.blocks, e.requested, e.blocks * self._block_size, e.stop, e.detail)
                    break
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED and self.outcome is None and self._cancelled:
                return   # close(): the caller stopped the stream
            # Cancelled by anyone else (the client closed, the daemon stopping) is an error, not a
            # quiet end with no outcome that looks like the caller's own close.
            raise self._client._error(exc) from None
        finally:
            if self.outcome is None:
                self._call.cancel()   # left early: the daemon drops the rest
                # the caller's doing, as close(): a later loop or wait() over this stream ends as
                # closed, not with the CANCELLED of a stopping daemon (DaemonNotRunning)
                self._cancelled = True
                if self._stream_id:
                    self._client._end_stream(self._session_id, self._stream_id)
            if lease_id and (self.outcome is None or self._arena is None or not self._keep_data
                             or time.monotonic() - self._started < ttl_s / 2):
                # Also when left early: the daemon may have finished and handed the lease to an
                # end this loop never read (releasing one it already dropped is a no-op). Well
                # inside the lease (the daemon holds it for the stream and ttl after its end),
                # every copy was pinned: the release need not be waited for.
                self._client._release_later(self._session_id, lease_id)
                lease_id = 0
        if lease_id:
            try:
                self._client._call(self._client._stub.Release,
                                   pb.ReleaseRequest(session_id=self._session_id, lease_id=lease_id))
            except LeaseExpired as exc:
                raise LeaseExpired(f"the stream's blocks were read after its lease ended: {exc}") from None
            except KVStoreError:
                pass   # not an expiry (the daemon went away after the end): the lease is gone with it

    def close(self) -> None:
        """Stop the stream before its end; its lease (if the loop saw it) is released when the
        loop exits. Without a loop, the daemon drops the lease when the call is cancelled or,
        at the latest, when it expires. Into engine buffers, returns once the daemon copies into
        them no more."""
        self._cancelled = True
        self._call.cancel()
        if self._stream_id and self.outcome is None:
            self._client._end_stream(self._session_id, self._stream_id)

    def wait(self) -> StreamOutcome:
        """Consume the stream without keeping the arrivals (nor copying their bytes); the outcome."""
        self._keep_data = False
        for _ in self:
            pass
        if self.outcome is None:   # the loop ends without an outcome only when the call was cancelled
            raise KVStoreError("the stream was closed before its end")
        return self.outcome
