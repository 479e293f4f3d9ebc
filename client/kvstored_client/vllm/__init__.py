"""kvstored as vLLM's external KV cache: the ``KVStoredConnector`` (``connector``), a
``KVConnectorBase_V1`` vLLM loads by module path, and its settings (``config``).

Importing this package imports nothing of vLLM; only ``kvstored_client.vllm.connector`` does, and vLLM
imports that module itself when it loads the connector.
"""
