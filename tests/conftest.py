"""Shared fixtures: a real PostgreSQL cluster per test session and a store URL on both backends."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from eventstore import upgrade_database
from eventstore.testing import PgCluster


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--crash-exhaustive",
        action="store_true",
        help="tests/crash: every byte prefix and every bit of each durable file, not the CI slice",
    )
    parser.addoption(
        "--mutants",
        choices=("fast", "all"),
        default="fast",
        help="fast (default): the catalogue's fast slice only; all: every mutant within its seed budget",
    )


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PgCluster]:
    """A throwaway cluster, started as the `postgres` user when the tests run as root."""
    cluster = PgCluster().start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def pg_url(pg_cluster: PgCluster) -> Iterator[str]:
    """A fresh, empty database on the session's cluster (no schema)."""
    name = pg_cluster.create_database()
    try:
        yield pg_cluster.url(name)
    finally:
        pg_cluster.drop_database(name)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / f'ledger-{uuid.uuid4().hex[:8]}.db'}"


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A migrated, empty log on each backend: every store test runs on both."""
    if request.param == "sqlite":
        url = str(request.getfixturevalue("sqlite_url"))
    else:
        url = str(request.getfixturevalue("pg_url"))
    upgrade_database(url)
    return url


# --- the mutant catalogue (tests/mutants): its fast slice runs by default, the rest with --mutants=all --


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `catalogue` are deselected (not skipped) unless `--mutants=all`."""
    if config.getoption("--mutants") == "all":
        return
    left_out = [item for item in items if item.get_closest_marker("catalogue") is not None]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if item.get_closest_marker("catalogue") is None]
