"""Fixtures of the projection tests: a fresh SQLite log and a builder over it, and fresh copies of a
migrated log for property tests."""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable, Iterator
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


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A migrated, empty log, copied for each example (a migration per example would dominate the test)."""
    path = tmp_path_factory.mktemp("template") / "ledger.db"
    open_store(f"sqlite:///{path}", migrate_schema=True).close()
    return path


@pytest.fixture
def fresh_store(template: Path, tmp_path: Path) -> Callable[[], EventStore]:
    """A new log copied from the template at each call (a hypothesis example each); the caller closes it."""

    def make() -> EventStore:
        path = tmp_path / f"ledger-{random.getrandbits(48):x}.db"
        shutil.copy(template, path)
        return open_store(f"sqlite:///{path}")

    return make
