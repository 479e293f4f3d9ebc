"""Peers: other kvstored daemons, and the bulk channel that moves blocks between them.

The peer block channel: blocks by key over TCP (optionally TLS), one frame per block, in order.
Control traffic between daemons goes over gRPC; this channel carries only block bytes, because a
2 MiB payload inside a protobuf message costs copies and framing that plain TCP does not.

The channel is mechanism only: it moves bytes by key, checks them and reports what happened; what
to fetch, from whom and where to keep it is decided by its callers (:mod:`kvstored.peers.node`).
Its parts: :mod:`~kvstored.peers.wire` (the format), :mod:`~kvstored.peers.auth` (who may talk),
:mod:`~kvstored.peers.byte_stream` (the byte stream under both ends), :mod:`~kvstored.peers.server`
(the listening end), :mod:`~kvstored.peers.connection` (the connecting end, and what a transfer
reports), :mod:`~kvstored.peers.errors`.

Contract:

* Blocks arrive in request order. A transfer stops at the first missing block: a chain is only
  useful up to its first gap.
* Every payload is verified against its checksum before it is handed over; a block that fails is
  never delivered, and the transfer ends there.
* The receiver reads each payload straight into its destination (a reused scratch buffer, or the
  caller's own buffer via ``into``); the sender writes the served memoryview without copying it.
* A fetch never hangs: it returns within ``deadline_s`` with a
  :class:`~kvstored.peers.connection.FetchResult` saying how many blocks were delivered and why it
  stopped. Credentials that the peer refuses, or a peer whose credentials we refuse, raise
  :class:`~kvstored.peers.errors.PeerAuthError`.
* Authentication is mutual TLS (:class:`~kvstored.peers.auth.TLSFiles`), a shared token (compared
  in constant time), or both. A listener on a non-loopback address refuses to start without either unless
  ``PeerAuth.insecure`` is set.
"""
