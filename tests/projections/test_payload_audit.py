"""`ledger audit` reads the payloads back: every claim's bytes against its digest, every digest an event
names stored, every row of the log's blob table intact, and the database's own integrity check."""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from typer.testing import CliRunner

from cli.main import app
from eventstore import EventStore, open_store, upgrade_database
from eventstore.payload_stores import payload_plane
from payloads import LOG_BLOBS_STORE, LocalDirPayloadStore, PayloadPlane
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


def history(store: EventStore, plane: PayloadPlane) -> LogBuilder:
    """Two groups whose replies are claimed in the payload store, one older group whose replies, token
    records and logprobs are in the log's blob table (written before claims)."""
    log = LogBuilder(store, payloads=plane)
    log.clean_sibling_group("new", step=1)
    log.clean_sibling_group("newer", step=2)
    old = LogBuilder(store)
    old.clean_sibling_group("old", step=3)
    old.logprobs("old_g0")
    return log


def claimed_at(store: EventStore, rollout_id: str) -> tuple[int, str]:
    """The position and digest of the try's RunReplied."""
    for e in store.read_all():
        if e.type == "RunReplied" and f'"{rollout_id}"' in e.data_json:
            return e.position, json.loads(e.data_json)["reply_digest"]
    raise AssertionError(rollout_id)


def test_a_clean_log_reads_back_every_claim(store: EventStore, tmp_path: Path) -> None:
    plane = payload_plane(store, (tmp_path / "payloads").as_uri())
    history(store, plane)
    report = audit_log(store, payloads=plane)
    assert report.ok, report.as_json()
    assert set(PAYLOAD_RULES) <= set(report.rules_checked)
    summary = report.payloads
    assert summary is not None
    # 4 claimed replies, 2 older replies, the older token records (one digest) and the logprobs
    assert (summary.claimed, summary.checked, summary.missing, summary.corrupt) == (8, 8, 0, 0)
    assert summary.log_blobs == 4 and summary.database.endswith(
        ("integrity_check: ok", "data checksums on, no failures")
    )
    assert audit_log(store).payloads is None  # without a plane: the events' rules alone


def test_an_edited_or_lost_payload_is_reported_at_the_event_that_claims_it(
    store: EventStore, tmp_path: Path
) -> None:
    plane = payload_plane(store, (tmp_path / "payloads").as_uri())
    history(store, plane)
    local = plane.stores[next(n for n in plane.stores if n != LOG_BLOBS_STORE)]
    assert isinstance(local, LocalDirPayloadStore)
    edited_at, edited = claimed_at(store, "new_g1")
    path = local.path_of(edited)
    path.write_bytes(path.read_bytes().replace(b"1.0", b"9.0"))
    lost_at, lost = claimed_at(store, "newer_g0")
    local.path_of(lost).unlink()

    report = audit_log(store, payloads=plane)
    found = {(v.rule, tuple(v.positions)) for v in report.violations}
    assert found == {(PAYLOAD_INTACT, (edited_at,)), (PAYLOAD_STORED, (lost_at,))}, report.as_json()
    message = next(v.message for v in report.violations if v.rule == PAYLOAD_INTACT)
    assert edited in message and "altered" in message
    assert report.payloads is not None and (report.payloads.missing, report.payloads.corrupt) == (1, 1)


def test_an_edited_log_blob_is_reported(store: EventStore, store_url: str, tmp_path: Path) -> None:
    plane = payload_plane(store, (tmp_path / "payloads").as_uri())
    history(store, plane)
    at, digest = claimed_at(store, "old_g1")
    engine = create_engine(store_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("UPDATE blobs SET content = :c WHERE digest = :d"), {"c": b"{}", "d": digest})
    finally:
        engine.dispose()

    report = audit_log(store, payloads=plane)
    assert [(v.rule, v.positions) for v in report.violations] == [(PAYLOAD_INTACT, [at])], report.as_json()
    assert digest in report.violations[0].message


def test_a_damaged_sqlite_file_fails_the_databases_own_check(sqlite_url: str, tmp_path: Path) -> None:
    """The blob table's pages overwritten: the events still read, SQLite's integrity_check does not pass."""
    upgrade_database(sqlite_url)
    store = open_store(sqlite_url)
    try:
        plane = payload_plane(store, (tmp_path / "payloads").as_uri())
        history(store, plane)
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
        with open(path, "r+b") as f:  # the blob table's root page: its b-tree header and cell pointers
            f.seek((root - 1) * page_size)
            f.write(b"\xee" * 64)
        store = open_store(sqlite_url)
        plane = payload_plane(store, (tmp_path / "payloads").as_uri())
        events = store.head()
        report = audit_log(store, payloads=plane)
    finally:
        store.close()
    rules = {v.rule for v in report.violations}
    assert DATABASE_INTEGRITY in rules, report.as_json()
    integrity = next(v for v in report.violations if v.rule == DATABASE_INTEGRITY)
    assert "SQLite integrity_check" in integrity.message
    assert report.events == events  # the events themselves were read whole
    assert any(
        v.rule in (PAYLOAD_INTACT, PAYLOAD_STORED) and "malformed" in v.message for v in report.violations
    )


def test_ledger_audit_reads_the_payloads_and_says_so_in_one_line(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    upgrade_database(url)
    store = open_store(url)
    try:
        plane = payload_plane(store)  # the default beside the log
        history(store, plane)
        assert (tmp_path / "ledger.db.payloads").is_dir()
        local = plane.stores[next(n for n in plane.stores if n != LOG_BLOBS_STORE)]
        assert isinstance(local, LocalDirPayloadStore)
        edited_at, edited = claimed_at(store, "new_g0")
    finally:
        store.close()
    runner = CliRunner()
    result = runner.invoke(app, ["audit", "--db", url])
    assert result.exit_code == 0 and "clean" in result.output and "8 of 8 claimed read back" in result.output
    local.path_of(edited).write_bytes(b"{}")
    result = runner.invoke(app, ["audit", "--db", url])
    assert result.exit_code == 1, result.output
    assert f"payload-intact at {edited_at}" in " ".join(result.output.split()), result.output
    # Another store named (none there): every claimed payload is missing from it.
    result = runner.invoke(app, ["audit", "--db", url, "--payloads", (tmp_path / "elsewhere").as_uri()])
    assert result.exit_code == 1 and "4 claimed payload(s) are not stored" in " ".join(result.output.split())
    assert not (tmp_path / "elsewhere").exists()  # a reader creates nothing
    # A relative path is the working directory's, and the violation says where it looked.
    with contextlib.chdir(tmp_path):
        result = runner.invoke(app, ["audit", "--db", url, "--payloads", "relative/dir"])
    said = "".join(result.output.split())
    assert result.exit_code == 1 and f"arenotstoredinstore'local'({tmp_path}/relative/dir)" in said, (
        result.output
    )
