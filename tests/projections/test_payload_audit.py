"""`ledger audit` reads the payloads back: every blob against its digest, every digest an event names
stored, and the database's own integrity check."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from typer.testing import CliRunner

from cli.main import app
from eventstore import EventStore, open_store, upgrade_database
from projections.audit import audit_log
from projections.payload_audit import DATABASE_INTEGRITY, PAYLOAD_INTACT, PAYLOAD_RULES, PAYLOAD_STORED
from tests.projections.builder import LogBuilder


@pytest.fixture
def store(store_url: str) -> Iterator[EventStore]:
    s = open_store(store_url)
    try:
        yield s
    finally:
        s.close()


def history(store: EventStore) -> None:
    log = LogBuilder(store)
    log.clean_sibling_group("one", step=1)
    log.clean_sibling_group("two", step=2)
    log.logprobs("one_g0")


def named_at(store: EventStore, rollout_id: str) -> tuple[int, str]:
    """The position and reply digest of the try's RunReplied."""
    for e in store.read_all():
        if e.type == "RunReplied" and f'"{rollout_id}"' in e.data_json:
            return e.position, str(json.loads(e.data_json)["reply_digest"])
    raise AssertionError(rollout_id)


def _sql(url: str, statement: str, params: dict[str, object]) -> None:
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(text(statement), params)
    finally:
        engine.dispose()


def test_a_clean_log_reads_back_every_payload(store: EventStore) -> None:
    history(store)
    report = audit_log(store, payloads=True)
    assert report.ok, report.as_json()
    assert set(PAYLOAD_RULES) <= set(report.rules_checked)
    p = report.payloads
    assert p is not None
    # 4 replies, the token records (one digest), the logprobs
    assert (p.named, p.checked, p.missing, p.corrupt, p.blobs) == (6, 6, 0, 0, 6)
    assert p.database.endswith(("integrity_check: ok", "data checksums on, no failures")), p.database
    assert audit_log(store).payloads is None  # the events' rules alone


def test_an_edited_or_lost_blob_is_reported_at_the_event_that_names_it(
    store: EventStore, store_url: str
) -> None:
    history(store)
    edited_at, edited = named_at(store, "one_g1")
    lost_at, lost = named_at(store, "two_g0")
    _sql(store_url, "UPDATE blobs SET content = :c WHERE digest = :d", {"c": b"{}", "d": edited})
    _sql(store_url, "DELETE FROM blobs WHERE digest = :d", {"d": lost})

    report = audit_log(store, payloads=True)
    found = {(v.rule, tuple(v.positions)) for v in report.violations}
    assert found == {(PAYLOAD_INTACT, (edited_at,)), (PAYLOAD_STORED, (lost_at,))}, report.as_json()
    message = next(v.message for v in report.violations if v.rule == PAYLOAD_INTACT)
    assert edited in message and "altered" in message
    assert report.payloads is not None and (report.payloads.missing, report.payloads.corrupt) == (1, 1)


def test_a_damaged_sqlite_file_fails_the_databases_own_check(sqlite_url: str) -> None:
    """The blob table's root page overwritten: the events still read, SQLite's integrity_check fails."""
    upgrade_database(sqlite_url)
    store = open_store(sqlite_url)
    history(store)
    for i in range(40):  # enough rows for the blob table to span pages of its own
        store.put_blob(bytes([i]) * 3000)
    store.close()  # the last connection: the WAL is checkpointed into the file
    path = sqlite_url.removeprefix("sqlite:///")
    conn = sqlite3.connect(path)
    try:
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        (root,) = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'blobs'").fetchone()
    finally:
        conn.close()
    with open(path, "r+b") as f:  # the root page's b-tree header and cell pointers
        f.seek((root - 1) * page_size)
        f.write(b"\xee" * 64)
    store = open_store(sqlite_url)
    try:
        events = store.head()
        report = audit_log(store, payloads=True)
    finally:
        store.close()
    integrity = [v for v in report.violations if v.rule == DATABASE_INTEGRITY]
    assert integrity and "SQLite integrity_check" in integrity[0].message, report.as_json()
    assert report.events == events  # the events themselves were read whole
    assert any(v.rule == PAYLOAD_INTACT and "malformed" in v.message for v in report.violations)


def test_ledger_audit_reads_the_payloads_and_says_so(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    upgrade_database(url)
    store = open_store(url)
    try:
        history(store)
        edited_at, edited = named_at(store, "one_g0")
    finally:
        store.close()
    runner = CliRunner()
    result = runner.invoke(app, ["audit", "--db", url])
    assert result.exit_code == 0 and "clean" in result.output, result.output
    assert "6 of 6 named read back" in " ".join(result.output.split()), result.output
    _sql(url, "UPDATE blobs SET content = :c WHERE digest = :d", {"c": b"{}", "d": edited})
    result = runner.invoke(app, ["audit", "--db", url])
    assert result.exit_code == 1, result.output
    assert f"payload-intact at {edited_at}" in " ".join(result.output.split()), result.output
