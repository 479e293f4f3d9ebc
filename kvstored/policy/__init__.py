"""Pure policy: decisions from block metadata and a clock; no tier, server or transport imports."""
