"""`open_payload_store(url)`: a backend chosen by URL, and the default store beside a log.

    memory://                              in this process only (tests)
    file:///var/lib/ledger/payloads        a local directory (or a plain path)
    postgresql+psycopg://user@host/db      large values in that PostgreSQL database
    s3://bucket/prefix?endpoint=URL&region=R   S3-compatible object storage

Beside a SQLite log `sqlite:///PATH` the default is the directory `PATH.payloads`; beside a
PostgreSQL log, large values in the same database (every host that reaches the log reaches them).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final
from urllib.parse import unquote, urlsplit

from payloads._errors import PayloadStoreError
from payloads._store import PayloadStore

PAYLOADS_ENV: Final = "LEDGER_PAYLOADS"


def open_payload_store(url: str, name: str | None = None) -> PayloadStore:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "memory":
        from payloads._memory import InMemoryPayloadStore

        return InMemoryPayloadStore(name)
    if scheme == "file" or (not scheme and url):
        from payloads._local import LocalDirPayloadStore

        path = unquote(parts.path) if scheme == "file" else url
        if not path:
            raise PayloadStoreError(f"payload store URL {url!r} names no directory")
        if scheme == "file" and parts.netloc not in ("", "localhost"):
            raise PayloadStoreError(
                f"payload store URL {url!r} names the host {parts.netloc!r}: a directory here is file:///DIR"
            )
        return LocalDirPayloadStore(path, name)
    if scheme.startswith("postgresql") or scheme == "postgres":
        from payloads._postgres import PostgresPayloadStore

        return PostgresPayloadStore(url, name)
    if scheme == "s3":
        from payloads._s3 import S3PayloadStore

        return S3PayloadStore.from_url(url, name)
    raise PayloadStoreError(
        f"unknown payload store URL {url!r}: use memory://, file:///DIR, postgresql+psycopg://... or s3://BUCKET/PREFIX"
    )


def default_payload_url(log_url: str) -> str:
    """The payload store beside the log at `log_url`, unless `LEDGER_PAYLOADS` names one."""
    return os.environ.get(PAYLOADS_ENV) or payload_url_beside(log_url)


def payload_url_beside(log_url: str) -> str:
    """The payload store beside the log at `log_url`, whatever `LEDGER_PAYLOADS` says."""
    parts = urlsplit(log_url)
    if parts.scheme.startswith("sqlite"):
        path = unquote(parts.path)[1:] if parts.path.startswith("/") else unquote(parts.path)
        if not path or path == ":memory:":
            return "memory://"
        return Path(path + ".payloads").resolve().as_uri()
    return log_url


__all__ = ["PAYLOADS_ENV", "default_payload_url", "open_payload_store", "payload_url_beside"]
