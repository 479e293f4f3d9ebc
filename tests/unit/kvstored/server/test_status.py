"""The daemon's side of the error contract: a domain error becomes its status code, its message
and its reason (an ErrorInfo in the rich status), which the SDK reads back as the same error."""

from __future__ import annotations

import base64
import urllib.parse

import grpc
import pytest

from kvstored.server.status import MAX_DETAILS_BYTES, rich_status
from kvstored_client.contract.errors import KVStoreError, LeaseExpired, NotFound, Reason
from kvstored_client.errors import _BY_REASON, from_rpc_error


class Call(grpc.RpcError):
    """How the SDK sees a call the daemon ended with ``status``."""

    def __init__(self, status: grpc.Status) -> None:
        self._status = status

    def code(self) -> grpc.StatusCode:
        return self._status.code  # type: ignore[no-any-return]

    def details(self) -> str:
        return self._status.details  # type: ignore[no-any-return]

    def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:
        return self._status.trailing_metadata  # type: ignore[no-any-return]


@pytest.mark.parametrize("reason", sorted(_BY_REASON))
def test_every_reason_the_daemon_raises_reaches_the_sdk_as_the_same_error(reason: str) -> None:
    cls = _BY_REASON[reason]
    status = rich_status(cls("what went wrong", reason))
    assert status.code == cls.code and status.details == "what went wrong"
    err = from_rpc_error(Call(status))
    assert type(err) is cls and err.reason == reason and str(err) == "what went wrong"


def test_the_generic_reason_travels_when_none_finer_was_given() -> None:
    err = from_rpc_error(Call(rich_status(NotFound("unknown peer 'x'"))))
    assert type(err) is NotFound and err.reason is Reason.NOT_FOUND
    expired = from_rpc_error(Call(rich_status(LeaseExpired("lease 3 expired"))))
    assert type(expired) is LeaseExpired and expired.reason is Reason.LEASE_EXPIRED


def test_an_error_without_a_status_code_travels_as_unknown() -> None:
    status = rich_status(KVStoreError("a bug"))
    assert status.code == grpc.StatusCode.UNKNOWN
    assert type(from_rpc_error(Call(status))) is KVStoreError


@pytest.mark.parametrize("text", ["z" * 20000, "é" * 3000, "%" * 5000])
def test_a_long_message_is_cut_so_both_its_copies_stay_under_the_metadata_limit(text: str) -> None:
    """The message travels in grpc-message (percent-encoded) and again in the rich status
    (base64): together past 8 KiB, a client may refuse the headers and report RESOURCE_EXHAUSTED
    in place of the status sent."""
    status = rich_status(NotFound(f"no namespace of model {text!r}", Reason.UNKNOWN_MODEL))
    header = urllib.parse.quote(status.details, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~")
    trailer = base64.b64encode(dict(status.trailing_metadata)["grpc-status-details-bin"])
    assert "more characters cut" in status.details
    assert len(header) + len(trailer) <= MAX_DETAILS_BYTES + 200 < 8 << 10


def test_a_message_holding_a_lone_surrogate_still_ends_the_call() -> None:
    """An OS error's text can carry an undecodable file name (a lone surrogate): protobuf would
    refuse it, and the call would end as UNKNOWN instead of its status."""
    status = rich_status(NotFound("cannot open '\udcff'", Reason.NOT_FOUND))
    assert status.code == grpc.StatusCode.NOT_FOUND and from_rpc_error(Call(status)).reason is Reason.NOT_FOUND
