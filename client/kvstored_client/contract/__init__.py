"""The contract the daemon and the SDK share: what one side writes, the other reads.

``proto``: the gRPC API (generated from proto/, drift-checked by tools/gen_proto.py); ``wire``:
SDK values to and from its messages; ``namespace``, ``hashing``, ``layout``: what makes two
blocks the same (namespace identity, block keys, the byte layout of engine buffers); ``errors``:
the failures a call ends with and the reason each carries on the wire; ``paths``: where the
daemon listens by default; ``shm_files``: which process owns a shared-memory file.
The daemon imports from the SDK only this package (and the top-level ``kvstored_client`` names).
"""
