"""Connectors the vLLM tests load instead of ``KVStoredConnector`` (in the vLLM environment):
``ZeroingConnector`` zeroes every block it loaded (the control: wrong KV must change the answer);
``KillingConnector`` SIGKILLs the daemon between a lookup that found blocks and their load, once
the file named by ``$KVSTORED_TEST_KILL`` holds the daemon's pid."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from kvstored_client.vllm.connector import KVStoredConnector


class ZeroingConnector(KVStoredConnector):
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        self.tensors = dict(kv_caches)   # vLLM's CPU layout: blocks first

    def wait_for_layer_load(self, layer_name: str) -> None:
        super().wait_for_layer_load(layer_name)   # this layer is loaded: zero it
        for spec in self._get_connector_metadata().loads:
            self.tensors[layer_name][list(spec.block_ids)] = 0


class KillingConnector(KVStoredConnector):
    killed = False

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        armed = Path(os.environ["KVSTORED_TEST_KILL"])
        if self._get_connector_metadata().loads and armed.exists() and not self.killed:
            pid = int(armed.read_text())
            os.kill(pid, signal.SIGKILL)
            stat = Path(f"/proc/{pid}/stat")
            # dead once it is a zombie (the test reaps it) or gone: its socket is closed by then
            while stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":
                time.sleep(0.01)
            self.killed = True
            print('KVSTORED-TEST {"killed": true}', flush=True)
        super().start_load_kv(forward_context, **kwargs)
