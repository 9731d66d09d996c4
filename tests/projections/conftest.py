"""Fixtures of the projection tests: a fresh SQLite log and a builder over it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from eventstore import EventStore, open_store
from tests.projections.builder import LogBuilder


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'ledger.db'}"


@pytest.fixture
def store(db_url: str) -> Iterator[EventStore]:
    s = open_store(db_url, migrate_schema=True)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def log(store: EventStore) -> LogBuilder:
    return LogBuilder(store)
