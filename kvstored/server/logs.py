"""The daemon's log set-up: one format on stderr (the journal), and grpc's report of a reply it
could not send to a client that had gone away kept out of the error log."""

from __future__ import annotations

import logging
from typing import TextIO

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
GRPC_LOGGER = "grpc._cython.cygrpc"
# grpc logs this, with a traceback, at ERROR when a servicer's message or status could not be sent
# because the call had ended meanwhile (the client closed or died as the reply left): nothing the
# daemon did wrong and nothing an operator can act on
CLIENT_GONE = "ExecuteBatchError raised in core by servicer method"


class ClientGoneFilter(logging.Filter):
    """Turns grpc's "could not send, the call had ended" error into one DEBUG line without its
    traceback, dropped unless the daemon logs at DEBUG; every other record passes unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(CLIENT_GONE):
            return True
        if not logging.getLogger("kvstored").isEnabledFor(logging.DEBUG):
            return False
        method = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
        record.msg, record.args = "reply to %s not sent: the client had gone", (method,)
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        record.exc_info, record.exc_text = None, None
        return True


def configure(level: str, stream: TextIO) -> None:
    """Log records at ``level`` and above to ``stream`` in the daemon's format, with
    :class:`ClientGoneFilter` on grpc's logger. Replaces any handlers the root logger had."""
    logging.basicConfig(level=level.upper(), stream=stream, format=FORMAT, force=True)
    grpc_log = logging.getLogger(GRPC_LOGGER)
    if not any(isinstance(f, ClientGoneFilter) for f in grpc_log.filters):
        grpc_log.addFilter(ClientGoneFilter())
