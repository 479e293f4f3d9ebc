"""The daemon's log: grpc's "client had gone" report stays out of the error log; the rest is
logged as before."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest

from kvstored.server import logs


@pytest.fixture
def configured() -> Iterator[tuple[io.StringIO, object]]:
    root = logging.getLogger()
    saved = root.handlers[:], root.level, logging.getLogger("kvstored").level
    grpc_log = logging.getLogger(logs.GRPC_LOGGER)
    saved_filters = grpc_log.filters[:]
    out = io.StringIO()

    def configure(level: str) -> None:
        logs.configure(level, out)

    yield out, configure
    root.handlers[:], root.level = saved[0], saved[1]
    logging.getLogger("kvstored").setLevel(saved[2])
    grpc_log.filters[:] = saved_filters


def _grpc_reports_client_gone() -> None:
    """What grpc's aio server logs when a reply could not be sent (its words, its logger)."""
    try:
        raise RuntimeError('Failed "execute_batch": (<SendMessageOperation>,)')
    except RuntimeError:
        logging.getLogger(logs.GRPC_LOGGER).exception(
            "ExecuteBatchError raised in core by servicer method [%s]", "/kvstored.v1.KVStore/Session")


def test_client_gone_is_not_an_error_at_info(configured) -> None:  # type: ignore[no-untyped-def]
    out, configure = configured
    configure("info")
    _grpc_reports_client_gone()
    logging.getLogger(logs.GRPC_LOGGER).error("something else broke")
    text = out.getvalue()
    assert "ExecuteBatchError" not in text and "Traceback" not in text
    assert "ERROR grpc._cython.cygrpc: something else broke" in text   # other grpc errors still show


def test_client_gone_is_one_debug_line_at_debug(configured) -> None:  # type: ignore[no-untyped-def]
    out, configure = configured
    configure("debug")
    configure("debug")   # configuring twice installs the filter once
    _grpc_reports_client_gone()
    lines = [line for line in out.getvalue().splitlines() if "grpc._cython.cygrpc" in line]
    assert len(lines) == 1, lines
    assert "DEBUG" in lines[0] and "/kvstored.v1.KVStore/Session" in lines[0] and "client had gone" in lines[0]
    assert "Traceback" not in out.getvalue()
    assert len([f for f in logging.getLogger(logs.GRPC_LOGGER).filters if isinstance(f, logs.ClientGoneFilter)]) == 1
