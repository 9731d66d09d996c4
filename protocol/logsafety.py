"""Keeping database passwords out of log lines: every record is masked once, when it is made.

`install_log_masking()` puts a record factory in front of `logging`'s own, so the message of every
record from every logger (ours, SQLAlchemy's, uvicorn's, alembic's) and the text of any traceback it
carries are masked before any handler or formatter sees them: `scheme://user:secret@host` becomes
`scheme://user:***@host` and a libpq `password=secret` becomes `password=***`.  It is idempotent and
process-wide; the `ledger` CLI and the reference agent install it at start.  `MaskingFilter` does
the same for a handler of a process that did not install the factory.
"""

from __future__ import annotations

import logging
import re
import threading
import traceback
from typing import Any, Final

MASK: Final = "***"

# scheme://user:password@  (the password may hold anything but '@' and whitespace; an URL-encoded
# password has no '@').  The user part stops at ':', '/' and '@'.
_URL_PASSWORD = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.\-]*://[^:/@\s]*:)(?P<password>[^@\s]+)(?P<at>@)")
# libpq key/value DSNs and query strings: password=secret, password='se cret'
_KV_PASSWORD = re.compile(r"(?P<head>\bpassword\s*=\s*)(?P<password>'(?:[^'\\]|\\.)*'|[^\s&;,)]+)", re.I)


def mask_text(text: str) -> str:
    """`text` with every database password replaced by `***`."""
    if "://" not in text and "password" not in text.lower():
        return text
    text = _URL_PASSWORD.sub(lambda m: f"{m['head']}{MASK}{m['at']}", text)
    return _KV_PASSWORD.sub(lambda m: f"{m['head']}{MASK}", text)


def mask_record(record: logging.LogRecord) -> logging.LogRecord:
    """Renders the record's message and traceback now, masked, so no formatter can see the secret."""
    try:
        message = record.getMessage()
    except Exception:  # a broken format string: leave it to logging's own error report
        return record
    masked = mask_text(message)
    if masked != message or not isinstance(record.msg, str):
        record.msg, record.args = masked, None
    if record.exc_info and record.exc_info[0] is not None and not record.exc_text:
        record.exc_text = mask_text("".join(traceback.format_exception(*record.exc_info)).rstrip("\n"))
    if record.stack_info:
        record.stack_info = mask_text(record.stack_info)
    return record


class MaskingFilter(logging.Filter):
    """A handler filter that masks the record (for handlers of processes without the factory)."""

    def filter(self, record: logging.LogRecord) -> bool:
        mask_record(record)
        return True


_lock = threading.Lock()
_installed = False


def install_log_masking() -> None:
    """Masks every log record made from now on in this process (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        previous = logging.getLogRecordFactory()

        def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
            return mask_record(previous(*args, **kwargs))

        logging.setLogRecordFactory(factory)
        _installed = True


__all__ = ["MASK", "MaskingFilter", "install_log_masking", "mask_record", "mask_text"]
