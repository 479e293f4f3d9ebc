"""KV events: what each daemon tells routers about the blocks it holds, in vLLM's format
(:mod:`kvstored.events.wire`), gathered from the store (:mod:`kvstored.events.recorder`) and sent
by a thread of its own (:mod:`kvstored.events.publisher`)."""
