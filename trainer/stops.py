"""A coordinator's stop, said once: the trainer's log line is for a library user, whose own code may
not report the `CoordinatorStopped` or `FencedOff` it gets; a caller that does say the stop in its own
words (`ledger simulate`'s one `error:` line, which names `--resume`) leaves that line out for the
while (`said_by_caller`), so the stop is not told twice."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

from trainer.errors import CoordinatorStopped, FencedOff
from trainer.settings import log

# The record's attribute that carries the stop it tells of.
_STOP: Final = "coordinator_stop"


def log_stop(what: str, exc: CoordinatorStopped | FencedOff) -> None:
    """`WHAT stops: REASON` in the trainer's log, the record carrying the stop."""
    log.error("%s stops: %s", what, exc, extra={_STOP: exc})


class _SaidByCaller(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not isinstance(getattr(record, _STOP, None), (CoordinatorStopped, FencedOff))


_SAID_BY_CALLER: Final = _SaidByCaller()


@contextmanager
def said_by_caller() -> Iterator[None]:
    """While inside, the trainer's log leaves out its lines for a `CoordinatorStopped` or `FencedOff`
    stop: the caller reports that stop itself."""
    log.addFilter(_SAID_BY_CALLER)
    try:
        yield
    finally:
        log.removeFilter(_SAID_BY_CALLER)
