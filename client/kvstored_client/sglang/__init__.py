"""SGLang integration: kvstored as a HiCache storage backend (``kvstored_client.sglang.hicache``).

Importing this package imports nothing of SGLang; SGLang loads the backend module itself.
"""
