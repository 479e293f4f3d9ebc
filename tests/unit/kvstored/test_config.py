"""Config: defaults, TOML, overrides, and errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstored import config
from kvstored.config import ConfigError
from kvstored.policy.registry import DEFAULT_POLICY

ROOT = Path(__file__).resolve().parents[3]


def test_embedded_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "SYSTEM_CONFIG", Path("/nonexistent/kvstored.toml"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1234")
    monkeypatch.delenv("KVSTORED_SOCKET", raising=False)
    cfg = config.load()
    assert cfg.dram.capacity == 1 << 30
    assert cfg.server.socket_mode == 0o660
    assert cfg.socket_path == "/run/user/1234/kvstored/kvstored.sock"


def test_default_socket_without_runtime_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("KVSTORED_SOCKET", raising=False)
    assert config.Config().socket_path.startswith("/tmp/kvstored-")


def test_file_then_overrides(tmp_path: Path) -> None:
    path = tmp_path / "k.toml"
    path.write_text('[dram]\ncapacity = "2GiB"\n[leases]\nttl_s = 5\n')
    cfg = config.load(str(path), ["dram.capacity=512MiB", "server.socket_mode=0600"])
    assert cfg.dram.capacity == 512 << 20
    assert cfg.leases.ttl_s == 5.0
    assert cfg.server.socket_mode == 0o600


def test_example_config_in_systemd_dir_is_valid() -> None:
    cfg = config.load(str(ROOT / "systemd" / "kvstored.toml"))
    assert cfg.dram.capacity == 8 << 30


@pytest.mark.parametrize(("toml", "needle"), [
    ("[dram]\ncapacty = 1\n", "dram.capacty: unknown key"),
    ("[dramm]\n", "dramm: unknown section"),
    ('[dram]\ncapacity = "lots"\n', "dram.capacity:"),
    ("[leases]\nttl_s = -1\n", "leases.ttl_s"),
    ('[log]\nlevel = "loud"\n', "log.level"),
    ('[server]\ntcp = "0.0.0.0:7070"\n', "server.tcp"),
    ("[dram]\nprefault = 3\n", "dram.prefault"),
    ('[dram]\npolicy = "fifo"\n', "dram.policy: must be one of lru, lfu, credit"),
    ('[ssd]\npolicy = "arc"\n', "ssd.policy: must be one of lru, lfu, credit"),
    ("[dram]\ncapacity = \"1MiB\"\npage_bytes = \"2MiB\"\n", "dram.capacity"),
])
def test_bad_values_name_the_key(tmp_path: Path, toml: str, needle: str) -> None:
    path = tmp_path / "k.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        config.load(str(path))


def test_policies_per_tier_default_to_the_trace_winner() -> None:
    cfg = config.Config()
    assert cfg.dram.policy == cfg.ssd.policy == DEFAULT_POLICY
    cfg = config.load(None, ["dram.policy=lru", "ssd.policy=lfu"])
    assert (cfg.dram.policy, cfg.ssd.policy) == ("lru", "lfu")


def test_insecure_tcp_must_be_explicit() -> None:
    with pytest.raises(ConfigError, match="insecure"):
        config.build({"server": {"tcp": "0.0.0.0:7070"}})
    cfg = config.build({"server": {"tcp": "0.0.0.0:7070", "insecure": True}})
    assert cfg.server.tcp == "0.0.0.0:7070"
    assert config.build({"server": {"tcp": "127.0.0.1:7070"}}).server.tcp == "127.0.0.1:7070"


def test_missing_file_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        config.load(str(tmp_path / "nope.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("[dram\n")
    with pytest.raises(ConfigError, match="bad.toml"):
        config.load(str(bad))


def test_malformed_override() -> None:
    with pytest.raises(ConfigError, match="section.key=value"):
        config.load(None, ["capacity=1"])


@pytest.mark.parametrize(("text", "value"), [("1GiB", 1 << 30), ("512 MiB", 512 << 20), ("4096", 4096),
                                              ("1.5KiB", 1536), ("2GB", 2 * 10**9)])
def test_parse_size(text: str, value: int) -> None:
    assert config.parse_size(text) == value
