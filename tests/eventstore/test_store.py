"""The store's guarantees, on SQLite and on a real PostgreSQL (the `store_url` fixture runs both)."""

from __future__ import annotations

import hashlib
import sqlite3
import uuid
from pathlib import Path

import pytest
from alembic import command
from sqlalchemy import create_engine, text

from eventstore import (
    DatabaseUnavailable,
    EventIdConflict,
    ExpectedVersion,
    InvalidEvent,
    NewEvent,
    NoSuchLog,
    UnknownEventType,
    UnknownMigrationHead,
    UnknownSchemaVersion,
    WrongExpectedVersion,
    open_store,
    upgrade_database,
)
from eventstore.events import AttemptMinted, GroupAbandoned, GroupReserved, PromptRef, RunFailed
from eventstore.records import GENESIS_HASH, Fence, canonical_uuid, chain_hash, new_event_ids, uuid5_text

TAMPER = """UPDATE events SET data = '{"rollout_id":"p1_g7","generation_index":7,"attempt_index":0}' WHERE position = 2"""


def tx_digest(content: bytes) -> str:
    return "sha256:" + hashlib.sha256(content).hexdigest()


def minted(i: int, group: str = "p1") -> AttemptMinted:
    return AttemptMinted(rollout_id=f"{group}_g{i}", generation_index=i)


def reserved(group: str = "p1") -> GroupReserved:
    return GroupReserved(
        group_id=group,
        prompt_ref=PromptRef(sample_id="s1", task_name="math"),
        agent_name="math-agent",
        expected_generations=2,
        mode="sibling",
    )


def test_append_and_read_back_typed(store_url: str) -> None:
    store = open_store(store_url)
    res = store.append("group-p1", [reserved(), minted(0), minted(1)], ExpectedVersion.NO_STREAM)
    assert res.positions == [1, 2, 3]
    assert res.stream_version == 2
    res2 = store.append("group-p2", [reserved("p2")], ExpectedVersion.NO_STREAM)
    assert res2.positions == [4] and res2.stream_version == 0

    events = list(store.read_all())
    assert [e.position for e in events] == [1, 2, 3, 4]
    assert [e.stream_version for e in events] == [0, 1, 2, 0]
    assert events[0].decode() == reserved()
    assert events[2].decode() == minted(1)
    assert events[0].data["group_id"] == "p1"
    assert events[0].metadata["pid"] > 0
    assert events[0].prev_hash == GENESIS_HASH and events[1].prev_hash == events[0].hash
    assert [e.position for e in store.read_all(from_position=2)] == [3, 4]
    assert [e.position for e in store.read_all(from_position=0, to_position=2)] == [1, 2]
    assert [e.stream_version for e in store.read_stream("group-p1", from_version=1)] == [1, 2]
    assert [e.type for e in store.read_all(types={"GroupReserved"})] == ["GroupReserved"] * 2
    assert store.head() == 4
    assert store.stream_version("group-p1") == 2 and store.stream_version("nope") == -1
    assert store.verify_chain() is None


def test_read_all_pages_in_order(store_url: str) -> None:
    store = open_store(store_url)
    for batch in range(5):
        store.append("group-p1", [minted(batch * 7 + i) for i in range(7)])
    positions = [e.position for e in store.read_all(batch_size=3)]
    assert positions == list(range(1, 36))


def test_expected_version_mismatch_writes_nothing(store_url: str) -> None:
    store = open_store(store_url)
    store.append("group-p1", [reserved()], ExpectedVersion.NO_STREAM)
    with pytest.raises(WrongExpectedVersion) as err:
        store.append("group-p1", [minted(0), minted(1)], ExpectedVersion.NO_STREAM)
    assert err.value.actual == 0 and "nothing was written" in str(err.value)
    with pytest.raises(WrongExpectedVersion):
        store.append("group-p1", [minted(0)], 5)
    assert store.head() == 1
    assert store.append("group-p1", [minted(0)], 0).stream_version == 1
    assert store.append("group-p1", [minted(1)], ExpectedVersion.ANY).stream_version == 2


def test_idempotent_append_by_event_id(store_url: str) -> None:
    store = open_store(store_url)
    ids = [str(uuid.uuid4()), str(uuid.uuid4())]
    batch = [NewEvent.of(minted(0), event_id=ids[0]), NewEvent.of(minted(1), event_id=ids[1])]
    first = store.append("group-p1", batch, ExpectedVersion.NO_STREAM)
    store.append("group-p1", [minted(2)])
    again = store.append("group-p1", batch, ExpectedVersion.NO_STREAM)
    assert again.positions == first.positions and again.idempotent
    assert store.head() == 3

    with pytest.raises(EventIdConflict):  # same id, other content
        store.append("group-p1", [NewEvent.of(minted(9), event_id=ids[0])])
    with pytest.raises(EventIdConflict):  # same id, other stream
        store.append("group-p9", [NewEvent.of(minted(0), event_id=ids[0])])
    with pytest.raises(EventIdConflict):  # a batch mixing recorded and new ids
        store.append("group-p1", [NewEvent.of(minted(0), event_id=ids[0]), NewEvent.of(minted(5))])
    assert store.head() == 3


def test_atomic_batch_with_a_bad_event_writes_nothing(store_url: str) -> None:
    store = open_store(store_url)
    store.append("group-p1", [reserved()])
    bad = NewEvent("AttemptMinted", {"rollout_id": "bad id with spaces", "generation_index": 0})
    with pytest.raises(InvalidEvent):
        store.append("group-p1", [minted(0), bad])
    with pytest.raises(UnknownEventType):
        store.append("group-p1", [minted(0), NewEvent("NoSuchEvent", {})])
    with pytest.raises(UnknownSchemaVersion):
        store.append("group-p1", [NewEvent("AttemptMinted", minted(0).model_dump(), schema_version=7)])
    with pytest.raises(InvalidEvent):
        store.append("group-p1", [NewEvent("AttemptMinted", {**minted(0).model_dump(), "extra": 1})])
    with pytest.raises(InvalidEvent):
        store.append("group-p1", [NewEvent("AttemptMinted", minted(0).model_dump(), event_id="not-a-uuid")])
    assert store.head() == 1
    assert store.verify_chain() is None


def test_upcaster_upgrades_an_old_row_on_read(store_url: str) -> None:
    store = open_store(store_url)
    old = {"rollout_id": "p1_g0", "attempt_index": 0, "reason": "deadline of 30 s passed"}
    store.append("group-p1", [NewEvent("RunFailed", old, schema_version=1)])
    row = next(iter(store.read_all()))
    assert row.schema_version == 1 and "kind" not in row.data  # stored row is never rewritten
    event = row.decode()
    assert isinstance(event, RunFailed) and event.kind == "deadline"
    assert RunFailed.schema_version == 2


def test_newer_schema_version_in_the_log_is_a_clear_error(store_url: str) -> None:
    store = open_store(store_url)
    store.append("group-p1", [minted(0)])
    row = next(iter(store.read_all()))  # variants of it as a newer writer or a corrupted disk would leave it
    newer = row._replace(schema_version=9)
    with pytest.raises(UnknownSchemaVersion, match="newer than this reader"):
        newer.decode()
    unknown = row._replace(type="Mystery")
    with pytest.raises(UnknownEventType):
        unknown.decode()
    corrupt = row._replace(data_json='{"rollout_id": 5')
    with pytest.raises(InvalidEvent, match="position 1"):
        corrupt.decode()


def test_log_is_append_only(store_url: str) -> None:
    store = open_store(store_url)
    store.append("group-p1", [minted(0)])
    engine = create_engine(store_url)
    for statement in ("UPDATE events SET type = 'X'", "DELETE FROM events"):
        with pytest.raises(Exception, match="append-only"), engine.begin() as conn:
            conn.execute(text(statement))
    if store_url.startswith("postgresql"):
        with pytest.raises(Exception, match="append-only"), engine.begin() as conn:
            conn.execute(text("TRUNCATE events"))
    assert store.head() == 1 and store.verify_chain() is None


def test_tampered_row_is_reported_by_the_chain(store_url: str) -> None:
    store = open_store(store_url)
    store.append("group-p1", [minted(i) for i in range(3)])
    store.append("group-p2", [minted(0, "p2")])
    engine = create_engine(store_url)
    with engine.begin() as conn:  # a superuser edits a row behind the trigger's back
        if store_url.startswith("postgresql"):
            conn.execute(text("ALTER TABLE events DISABLE TRIGGER events_no_update_delete"))
            conn.exec_driver_sql(TAMPER)
            conn.execute(text("ALTER TABLE events ENABLE TRIGGER events_no_update_delete"))
        else:
            conn.execute(text("DROP TRIGGER events_no_update"))
            conn.exec_driver_sql(TAMPER)
    assert store.verify_chain() == 2
    breaks = list(store.chain_breaks())
    assert [(b.position, "content" in b.reason) for b in breaks] == [(2, True)]


def test_deleted_event_is_reported_by_the_chain(store_url: str) -> None:
    store = open_store(store_url)
    store.append("group-p1", [minted(0), minted(1)])
    store.append("group-p2", [minted(0, "p2")])
    engine = create_engine(store_url)
    with engine.begin() as conn:  # delete the last event of stream group-p1
        if store_url.startswith("postgresql"):
            conn.execute(text("ALTER TABLE events DISABLE TRIGGER events_no_update_delete"))
            conn.execute(text("DELETE FROM events WHERE position = 2"))
            conn.execute(text("ALTER TABLE events ENABLE TRIGGER events_no_update_delete"))
        else:
            conn.execute(text("DROP TRIGGER events_no_delete"))
            conn.execute(text("DELETE FROM events WHERE position = 2"))
    assert store.verify_chain() == 3
    assert "missing" in next(iter(store.chain_breaks())).reason


def test_blobs_are_content_addressed(store_url: str) -> None:
    store = open_store(store_url)
    with store.transaction() as tx:
        digest = tx.put_blob(b"[1,2,3]")
        assert tx.put_blob(b"[1,2,3]") == digest
        tx.append("group-p1", [minted(0)])
    assert digest.startswith("sha256:") and store.get_blob(digest) == b"[1,2,3]"
    assert store.get_blob("sha256:" + "0" * 64) is None


def test_failed_transaction_rolls_back_blobs_positions_and_events(store_url: str) -> None:
    store = open_store(store_url)
    store.append("group-p1", [reserved()])
    with pytest.raises(WrongExpectedVersion), store.transaction() as tx:
        digest = tx.put_blob(b"tokens")
        tx.save_position("worker-1", 99)
        tx.append("group-p2", [reserved("p2")])
        tx.append("group-p1", [minted(0)], ExpectedVersion.NO_STREAM)
    assert store.get_blob(digest) is None
    assert store.subscriber_position("worker-1") == 0
    assert store.head() == 1
    # the next append takes the next contiguous position: a rollback leaves no hole
    assert store.append("group-p1", [minted(0)]).positions == [2]


def test_append_batch_chains_streams_and_writes_blobs_in_one_go(store_url: str) -> None:
    store = open_store(store_url)
    store.append("group-p1", [reserved()])
    with store.transaction() as tx:
        results = tx.append_batch(
            [
                ("group-p1", [minted(0)], 0),
                ("group-p2", [reserved("p2"), minted(0, "p2")], ExpectedVersion.NO_STREAM),
                ("group-p1", [minted(1)], 1),  # chains behind the batch's first append to p1
            ],
            [b"tokens-a", b"tokens-b"],
        )
    assert [(r.positions, r.stream_version) for r in results] == [([2], 1), ([3, 4], 1), ([5], 2)]
    assert [e.stream_version for e in store.read_stream("group-p1")] == [0, 1, 2]
    assert store.get_blob(tx_digest(b"tokens-b")) == b"tokens-b"
    assert store.verify_chain() is None
    # What the batch says it wrote is exactly what the log holds, hashes and all.
    assert [r for result in results for r in result.records] == list(store.read_all(1))


def test_append_batch_retried_with_the_same_ids_is_idempotent(store_url: str) -> None:
    store = open_store(store_url)
    batch = [
        ("group-p1", [NewEvent.of(reserved(), event_id=uuid.uuid4())], ExpectedVersion.NO_STREAM),
        ("group-p2", [NewEvent.of(reserved("p2"), event_id=uuid.uuid4())], ExpectedVersion.NO_STREAM),
    ]
    with store.transaction() as tx:
        first = tx.append_batch(batch)
    with store.transaction() as tx:  # a retry after a commit whose answer was lost
        again = tx.append_batch(batch)
    assert [r.positions for r in again] == [r.positions for r in first] == [[1], [2]]
    assert all(r.idempotent and not r.records for r in again)
    assert not any(r.idempotent for r in first) and store.head() == 2


def test_append_batch_keeps_every_character_of_the_payload(store_url: str) -> None:
    store = open_store(store_url)
    # The unit separator and NUL too: JSON escapes them, so they never split the packed arguments.
    tricky = 'quote " backslash \\ newline \n tab \t é ß 中文 😀 \u2028 {"json": [1]} \x1f unit \x00 nul'
    events = [GroupAbandoned(group_id=f"g{i}", reason=tricky + str(i)) for i in range(2)]
    with store.transaction() as tx:
        tx.append_batch([("group-g0", [events[0]], -1), ("group-g1", [events[1]], -1)])
    assert [e.decode() for e in store.read_all()] == events
    assert store.verify_chain() is None


def test_append_batch_refusal_names_its_stream_and_writes_nothing(store_url: str) -> None:
    store = open_store(store_url)
    store.append("group-p1", [reserved()])
    with pytest.raises(WrongExpectedVersion) as refused, store.transaction() as tx:
        tx.append_batch(
            [
                ("group-p2", [reserved("p2")], ExpectedVersion.NO_STREAM),
                ("group-p1", [minted(0)], 5),
                ("group-p3", [reserved("p3")], ExpectedVersion.NO_STREAM),
            ],
            [b"never-kept"],
        )
    assert (refused.value.stream_id, refused.value.expected, refused.value.actual) == ("group-p1", 5, 0)
    assert store.head() == 1 and store.get_blob(tx_digest(b"never-kept")) is None


def test_every_append_path_chains_alike_in_one_stream(store_url: str) -> None:
    """One stream written by every kind of append (lone, several events, two in one call, a chosen id,
    fenced, refused in a transaction): one unbroken chain that the client's `chain_hash` recomputes
    link by link, at gap-free positions."""
    store = open_store(store_url)
    store.append("group-p1", [reserved()], ExpectedVersion.NO_STREAM)
    store.append("group-p1", [minted(0), minted(1)], 0)
    with store.transaction() as tx:  # two appends in one call
        tx.append("group-p1", [minted(2)], 2)
        tx.append_batch([("group-p1", [minted(3)], 3), ("group-p1", [minted(4)], 4)])
    store.append("group-p1", [NewEvent.of(minted(5), event_id=uuid.uuid4())])  # a chosen id
    store.append("owner", [reserved("owner")])
    store.append("group-p1", [minted(6)], fence=Fence("owner", 0))
    with pytest.raises(WrongExpectedVersion) as refused, store.transaction() as tx:
        tx.append("group-p1", [minted(7)], 3)  # a lone append refused in a transaction
    assert refused.value.actual == 7
    events = list(store.read_stream("group-p1"))
    assert [e.stream_version for e in events] == list(range(8))
    assert [e.position for e in events] == [*range(1, 8), 9]
    prev = GENESIS_HASH
    for e in events:
        assert e.prev_hash == prev
        assert e.hash == chain_hash(
            prev,
            e.stream_id,
            e.stream_version,
            e.event_id,
            e.type,
            e.schema_version,
            e.data_json,
            e.metadata_json,
        )
        prev = e.hash
    assert store.verify_chain() is None


def test_packed_arguments_that_disagree_on_their_counts_are_refused_whole(pg_url: str) -> None:
    """A separator inside a packed element would split it: the append function counts every column
    against the streams and events it was given and refuses the call (LE004), writing nothing."""
    upgrade_database(pg_url)
    store = open_store(pg_url)
    call = (
        "SELECT * FROM ledger_append_events(%s, '-2', 'f', '1', %s, 'GroupReserved', '1', %s, '{}', "
        "0::float8, NULL, NULL, false, NULL, NULL, false)"
    )
    good = reserved().model_dump_json()
    with store._writer.connect() as conn:
        driver = conn.connection.driver_connection
        assert driver is not None
        for stream, data in (("group-p1\x1fgroup-p2", good), ("group-p1", good + "\x1f" + good)):
            with pytest.raises(Exception, match="disagree on their counts") as refused:
                driver.execute(call, (stream, str(uuid.uuid4()), data))
            assert getattr(refused.value, "sqlstate", None) == "LE004"
            driver.rollback()
    assert store.head() == 0


def test_subscription_catches_up_follows_and_resumes(store_url: str) -> None:
    store = open_store(store_url)
    store.append("group-p1", [minted(i) for i in range(3)])
    sub = store.subscribe("proj-a")
    assert [e.position for e in sub.poll()] == [1, 2, 3]
    assert sub.poll() == []
    store.append("group-p1", [minted(3)])
    seen = [e.position for e in sub.follow(idle_timeout_s=0.2)]
    assert seen == [4]
    sub.commit(2)  # processed up to 2 only: at-least-once redelivers 3 and 4
    resumed = store.subscribe("proj-a")
    assert [e.position for e in resumed.poll()] == [3, 4]
    with store.transaction() as tx:  # position stored with the subscriber's own output
        tx.append("out-1", [minted(9, "out")])
        resumed.commit(tx=tx)
    assert store.subscriber_position("proj-a") == 4
    assert [e.position for e in store.subscribe("other", from_position=4).poll()] == [5]


def test_unreachable_database_is_a_typed_error_with_the_password_masked() -> None:
    url = "postgresql+psycopg://ledger:s3cret@127.0.0.1:1/ledger"
    with pytest.raises(DatabaseUnavailable) as err:
        open_store(url)
    assert "s3cret" not in str(err.value) and "***" in str(err.value)


def test_unknown_migration_head_is_refused(sqlite_url: str, tmp_path: object) -> None:
    path = Path(sqlite_url.removeprefix("sqlite:///"))
    with pytest.raises(NoSuchLog):  # no file there: an open that does not migrate makes none
        open_store(sqlite_url)
    assert not path.exists()
    sqlite3.connect(path).close()  # a SQLite file with no ledger schema
    with pytest.raises(UnknownMigrationHead, match="ledger db upgrade"):
        open_store(sqlite_url)
    store = open_store(sqlite_url, migrate_schema=True)
    store.close()
    engine = create_engine(sqlite_url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '9999_future'"))
    with pytest.raises(UnknownMigrationHead, match="9999_future"):
        open_store(sqlite_url)
    with pytest.raises(UnknownMigrationHead):  # an unknown head is never "upgraded" blindly
        open_store(sqlite_url, migrate_schema=True)


def test_unknown_migration_head_on_postgres(pg_url: str) -> None:
    with pytest.raises(UnknownMigrationHead, match="no ledger schema"):
        open_store(pg_url)


def test_migrations_go_down_and_up_again_on_postgres(pg_url: str) -> None:
    from eventstore import migrate
    from eventstore.backends import create_engines

    upgrade_database(pg_url)
    writer, _ = create_engines(pg_url, pool_size=1)
    config = migrate.alembic_config()
    with writer.begin() as conn:
        config.attributes["connection"] = conn
        command.downgrade(config, "0002")
    assert migrate.current_revision(writer) == "0002"
    store = open_store(pg_url, migrate_schema=True)  # upgrades to the head again
    assert migrate.current_revision(writer) == migrate.head_revision()
    with store.transaction() as tx:
        tx.append_batch([("group-p1", [reserved()], -1), ("group-p2", [reserved("p2")], -1)])
    assert store.head() == 2 and store.verify_chain() is None


def test_append_rejects_empty_and_bad_arguments(store_url: str) -> None:
    store = open_store(store_url)
    with pytest.raises(ValueError):
        store.append("group-p1", [])
    with pytest.raises(ValueError):
        store.append("", [minted(0)])
    with pytest.raises(TypeError):
        store.append("group-p1", [{"type": "AttemptMinted"}])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        store.append("group-p1", [minted(0)], -7)
    assert store.head() == 0


def test_notify_subscription_follows_appends(pg_url: str) -> None:
    """With NOTIFY on, a follower waits on LISTEN instead of sleeping, and sees every append once."""
    import threading

    from eventstore import upgrade_database

    upgrade_database(pg_url)
    store = open_store(pg_url, notify=True)
    sub = store.subscribe("listener", from_position=0, poll_interval_s=5.0)
    seen: list[int] = []

    def follow() -> None:
        for ev in sub.follow(idle_timeout_s=8.0):
            seen.append(ev.position)
            if len(seen) == 3:
                sub.stop()

    t = threading.Thread(target=follow)
    t.start()
    for i in range(3):
        store.append("group-n", [minted(i, "n")])
    t.join(20)
    assert not t.is_alive()
    assert seen == [1, 2, 3]


def test_writer_sessions_plan_index_scans_and_keep_the_urls_own_options(pg_url: str) -> None:
    """The append function carries no per-call SET clause (migration 0006): the writer's sessions set
    `enable_seqscan = off` when they connect, after any `options` the URL itself gives."""
    upgrade_database(pg_url)
    store = open_store(pg_url + "?options=-c%20statement_timeout%3D12345")
    with store._writer.connect() as conn:
        assert conn.execute(text("SHOW enable_seqscan")).scalar() == "off"
        assert conn.execute(text("SHOW statement_timeout")).scalar() == "12345ms"
        config = conn.execute(
            text("SELECT proconfig FROM pg_proc WHERE proname = 'ledger_append_events'")
        ).scalar()
        assert config is None
    with store.read_connection() as conn:  # readers plan as the server says
        assert conn.execute(text("SHOW enable_seqscan")).scalar() == "on"
    store.append("group-p1", [reserved()])
    assert store.head() == 1 and store.verify_chain() is None


def test_get_blobs_reads_many_in_one_query(store_url: str) -> None:
    store = open_store(store_url)
    first, second = store.put_blob(b'{"a":1}'), store.put_blob(b"\x00binary", "application/octet-stream")
    missing = "sha256:" + "0" * 64
    assert store.get_blobs([first, second, missing, first]) == {first: b'{"a":1}', second: b"\x00binary"}
    assert store.get_blobs([]) == {}


def test_new_event_ids_are_distinct_version_4_uuids() -> None:
    ids = new_event_ids(2000) + new_event_ids(1)
    assert len(set(ids)) == len(ids) == 2001
    for text_id in ids:
        parsed = uuid.UUID(text_id)
        assert str(parsed) == text_id and parsed.version == 4 and parsed.variant == uuid.RFC_4122
    assert new_event_ids(0) == []


def test_uuid5_text_is_the_standard_librarys_uuid5() -> None:
    namespace = uuid.UUID("6f1d7c1e-4d0e-4b55-9f0e-2b7a61c0a8d1")
    for name in ("", "a", "ab" * 32, "take-over/é/group-1", "\x1f" * 70):
        assert uuid5_text(namespace.bytes, name) == str(uuid.uuid5(namespace, name))


@pytest.mark.parametrize(
    "given",
    ["0b4f5c1e-2d3a-5b6c-8d7e-9f0a1b2c3d4e", "0B4F5C1E-2D3A-5B6C-8D7E-9F0A1B2C3D4E",
     "{0b4f5c1e-2d3a-5b6c-8d7e-9f0a1b2c3d4e}", "urn:uuid:0b4f5c1e-2d3a-5b6c-8d7e-9f0a1b2c3d4e",
     "0b4f5c1e2d3a5b6c8d7e9f0a1b2c3d4e"],
)  # fmt: skip
def test_a_chosen_event_id_is_stored_as_the_standard_library_writes_it(given: str) -> None:
    assert canonical_uuid(given) == str(uuid.UUID(given))


@pytest.mark.parametrize(
    "given",
    ["", "not-a-uuid", "0b4f5c1e-2d3a-5b6c-8d7e-9f0a1b2c3d4", "0b4f5c1e-2d3a-5b6c-8d7e-9f0a1b2c3d4e\n"],
)
def test_a_chosen_event_id_that_is_no_uuid_is_refused(given: str) -> None:
    with pytest.raises(ValueError):
        canonical_uuid(given)


def test_a_forked_childs_appends_name_the_child() -> None:
    """The writer metadata on every append carries the pid of the process that appended."""
    import json
    import os

    from eventstore.store import _checked

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: render one append's metadata and hand its pid back
        try:
            os.write(
                write,
                str(
                    json.loads(_checked("group-p1", [reserved()], -2, None, None).rows[0].metadata)["pid"]
                ).encode(),
            )
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        named = int(pipe.read())
    os.waitpid(pid, 0)
    assert named == pid != os.getpid()
    assert (
        json.loads(_checked("group-p1", [reserved()], -2, None, None).rows[0].metadata)["pid"] == os.getpid()
    )
