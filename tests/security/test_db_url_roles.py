"""Which database URL (hence which role) a `ledger` command connects with."""

from __future__ import annotations

import pytest

from cli.common import AUDITOR_ENV, WRITER_ENV, db_url
from eventstore.backends import DEFAULT_URL

WRITER = "postgresql+psycopg://ledger_writer:w@db/ledger"
AUDITOR = "postgresql+psycopg://ledger_auditor:a@db/ledger"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(WRITER_ENV, raising=False)
    monkeypatch.delenv(AUDITOR_ENV, raising=False)


def test_writers_take_ledger_db(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WRITER_ENV, WRITER)
    monkeypatch.setenv(AUDITOR_ENV, AUDITOR)
    assert db_url(None) == WRITER
    assert db_url(None, role="writer") == WRITER


def test_readers_take_the_auditor_url_when_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WRITER_ENV, WRITER)
    assert db_url(None, role="auditor") == WRITER  # no auditor configured: the one log there is
    monkeypatch.setenv(AUDITOR_ENV, AUDITOR)
    assert db_url(None, role="auditor") == AUDITOR


def test_an_explicit_db_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WRITER_ENV, WRITER)
    monkeypatch.setenv(AUDITOR_ENV, AUDITOR)
    assert db_url("sqlite:///x.db", role="auditor") == "sqlite:///x.db"
    assert db_url("sqlite:///x.db", role="writer") == "sqlite:///x.db"


def test_default_and_unknown_role() -> None:
    assert db_url(None) == DEFAULT_URL
    assert db_url(None, role="auditor") == DEFAULT_URL
    with pytest.raises(ValueError):
        db_url(None, role="admin")  # type: ignore[arg-type]
