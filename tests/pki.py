"""The TLS tests' certificates (:mod:`tools.pki`), and a guard that skips a test, saying why, when
the ``cryptography`` package that makes them is missing."""

from __future__ import annotations

import pytest

from tools import pki
from tools.pki import Issued, make_ca, make_leaf, write

__all__ = ["Issued", "make_ca", "make_leaf", "require", "write"]


def require() -> None:
    if not pki.available:
        pytest.skip("the cryptography package is needed to generate test certificates (pip install cryptography)")
