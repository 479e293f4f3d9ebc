"""Side-by-side benchmark of kvstored against same-run limits and peers: ``python -m tools.bench``."""
