"""A real log made by `ledger simulate` (faults, checkpoints, claims), scored by a logprob worker and
checkpointed by the projection runner, shared by the console's page tests of one test process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from eventstore import EventStore, open_store
from tests.console.processes import ledger
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


@pytest.fixture(scope="session")
def simulated(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The URL of a SQLite log of 16 prompt groups of 4 (the default fault mix: lost replies, failed
    tries, hangs), every sealed try scored by `ledger worker logprobs`, and a projection checkpoint
    stored by `ledger projections run` (the console loads it and folds the tail); checkpoints taken
    while it ran."""
    folder: Path = tmp_path_factory.mktemp("simulated")
    db = f"sqlite:///{folder / 'ledger.db'}"
    # 1 s model calls and a checkpoint every 0.2 s: checkpoints are taken however fast the machine
    # (a run that ends before its first checkpoint has none to show).
    paced = ["--checkpoint-every", "0.2", "--call-seconds", "1"]
    ledger("simulate", "--db", db, "--groups", "16", "--agents", "2", *paced)
    ledger("worker", "logprobs", "--db", db, "--once", "--backend", "torch")
    ledger("projections", "run", "--db", db, "--once", "--checkpoint-every", "100")
    return db
