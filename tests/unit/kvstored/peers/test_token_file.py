"""peers.token_file: the token is the first non-empty line, stripped; an empty file is an error naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstored.config import ConfigError, PeersConfig
from kvstored.peers.node import auth_from_config


@pytest.mark.parametrize("content", ["s3cret", "s3cret\n", "  s3cret  \n", "\n\n  s3cret\nignored\n",
                                     "\r\n\ts3cret\r\n"])
def test_token_is_the_first_non_empty_line_stripped(tmp_path: Path, content: str) -> None:
    path = tmp_path / "token"
    path.write_bytes(content.encode())
    assert auth_from_config(PeersConfig(token_file=str(path))).token == "s3cret"


@pytest.mark.parametrize("content", ["", "\n", "  \n\t\n"])
def test_empty_token_file_is_an_error_naming_the_key(tmp_path: Path, content: str) -> None:
    path = tmp_path / "token"
    path.write_text(content)
    with pytest.raises(ConfigError) as exc:
        auth_from_config(PeersConfig(token_file=str(path)))
    assert str(exc.value) == f"peers.token_file {path} is empty"


def test_unreadable_token_file_names_the_key_and_the_reason(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"peers\.token_file: cannot read a token from .*: No such file"):
        auth_from_config(PeersConfig(token_file=str(tmp_path / "missing")))
    with pytest.raises(ConfigError, match=r"peers\.token_file: cannot read a token from .*: Is a directory"):
        auth_from_config(PeersConfig(token_file=str(tmp_path)))


def test_token_file_is_preferred_over_the_inline_token(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("from-file\n")
    assert auth_from_config(PeersConfig(token="inline", token_file=str(path))).token == "from-file"
    assert auth_from_config(PeersConfig(token="inline")).token == "inline"


def test_a_token_longer_than_the_protocol_carries_is_a_config_error(tmp_path: Path) -> None:
    """(peers review) A token over 64 KiB made every connection to a peer fail with an uncaught
    struct.error packing the HELLO; it is refused when the config is read, naming the key."""
    path = tmp_path / "token"
    path.write_text("t" * (1 << 16))
    with pytest.raises(ConfigError, match=r"peers\.token_file .*: the token has 65536 bytes; .* at most 65535"):
        auth_from_config(PeersConfig(token_file=str(path)))
    with pytest.raises(ConfigError, match=r"^peers\.token: the token has 65536 bytes"):
        auth_from_config(PeersConfig(token="é" * (1 << 15)))
    assert auth_from_config(PeersConfig(token="t" * 65535)).token == "t" * 65535
