"""The router: a global index of which node holds which blocks (fed by KV events), and the
choice of a node for each request by estimated time to first token. A process of its own
(``kvstored-router``); it imports nothing of the store, tiers or server."""
