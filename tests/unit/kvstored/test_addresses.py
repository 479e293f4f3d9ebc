"""Addresses as configuration and peers give them."""

from __future__ import annotations

import pytest

from kvstored.addresses import parse_address


def test_address_parsing() -> None:
    assert parse_address("10.0.0.1:7070") == ("10.0.0.1", 7070)
    assert parse_address("[::1]:7070") == ("::1", 7070)
    assert parse_address(("h", 1)) == ("h", 1)
    with pytest.raises(ValueError):
        parse_address("nohost")
