"""The vLLM connector's settings from ``kv_connector_extra_config``: defaults, and a mistake named
at start-up rather than a cache silently off."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvstored_client.vllm.config import ConnectorConfig


def test_defaults_load_and_save_on_the_default_socket() -> None:
    config = ConnectorConfig.from_extra(None)
    assert (config.socket, config.load, config.save, config.push_to) == ("", True, True, "")
    assert (config.zero_copy, config.layerwise, config.peers) == (True, True, False)


def test_values_are_taken() -> None:
    config = ConnectorConfig.from_extra({"socket": "/run/kv.sock", "save": False, "timeout_s": 2, "model": "m"})
    assert (config.socket, config.save, config.timeout_s, config.model) == ("/run/kv.sock", False, 2.0, "m")


@pytest.mark.parametrize("extra, named", [
    ({"sockett": "/x"}, "sockett"),
    ({"save": "no"}, "save"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"timeout_s": True}, "timeout_s"),
    ({"socket": 3}, "socket"),
])
def test_a_mistake_is_refused_naming_the_key(extra: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        ConnectorConfig.from_extra(extra)


def test_importing_the_sdk_and_its_vllm_package_imports_no_vllm() -> None:
    code = "import sys, kvstored_client, kvstored_client.vllm.config; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_a_producer_never_loads_and_a_consumer_saves_only_if_told() -> None:
    producer = ConnectorConfig.from_extra({"push_to": "decode"}, "kv_producer")
    assert (producer.load, producer.save, producer.waits_for_arrivals) == (False, True, False)
    consumer = ConnectorConfig.from_extra({"peers": True}, "kv_consumer")
    assert (consumer.load, consumer.save, consumer.waits_for_arrivals) == (True, False, True)
    assert ConnectorConfig.from_extra({"save": True}, "kv_consumer").save
    assert not ConnectorConfig.from_extra({}, "kv_consumer").waits_for_arrivals   # no peers: takes what is local
    both = ConnectorConfig.from_extra({"peers": True}, "kv_both")
    assert (both.load, both.save, both.waits_for_arrivals) == (True, True, False)


@pytest.mark.parametrize("extra, role, named", [
    ({"load": True}, "kv_producer", "never loads"),
    ({"load": False}, "kv_consumer", "loads"),
    ({"push_to": "decode"}, "kv_consumer", "save: true"),
    ({"max_wait_s": 1}, "kv_consumer", "peers: true"),
    ({"max_wait_s": 1, "peers": True}, "kv_both", "kv_consumer"),
    ({"prefill_tokens_per_s": 100}, "kv_producer", "kv_consumer"),
    ({}, "kv_decoder", "kv_role"),
])
def test_settings_that_contradict_the_role_are_refused_with_the_reason(
        extra: dict[str, object], role: str, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        ConnectorConfig.from_extra(extra, role)
