"""Superuser edits behind the append-only trigger's back, and rows a writer could never append."""

from __future__ import annotations

import json
import uuid

from sqlalchemy import create_engine, text

from eventstore import EventStore
from eventstore.records import GENESIS_HASH, chain_hash


def _run_without_trigger(url: str, statement: str, params: dict[str, object]) -> None:
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            if url.startswith("postgresql"):
                conn.execute(text("ALTER TABLE events DISABLE TRIGGER events_no_update_delete"))
                conn.execute(text(statement), params)
                conn.execute(text("ALTER TABLE events ENABLE TRIGGER events_no_update_delete"))
            else:
                # SQLite has no DISABLE TRIGGER: drop both, edit, recreate them as the migration wrote them.
                conn.execute(text("DROP TRIGGER events_no_update"))
                conn.execute(text("DROP TRIGGER events_no_delete"))
                conn.execute(text(statement), params)
                conn.execute(
                    text(
                        "CREATE TRIGGER events_no_update BEFORE UPDATE ON events "
                        "BEGIN SELECT RAISE(ABORT, 'the event log is append-only: UPDATE refused'); END"
                    )
                )
                conn.execute(
                    text(
                        "CREATE TRIGGER events_no_delete BEFORE DELETE ON events "
                        "BEGIN SELECT RAISE(ABORT, 'the event log is append-only: DELETE refused'); END"
                    )
                )
    finally:
        engine.dispose()


def edit_data(url: str, position: int, data: dict[str, object] | str) -> None:
    """Rewrites the payload of one row, leaving its hash as it was."""
    value = data if isinstance(data, str) else json.dumps(data)
    cast = "CAST(:d AS json)" if url.startswith("postgresql") else ":d"
    _run_without_trigger(
        url, f"UPDATE events SET data = {cast} WHERE position = :p", {"d": value, "p": position}
    )


def delete_row(url: str, position: int) -> None:
    _run_without_trigger(url, "DELETE FROM events WHERE position = :p", {"p": position})


def append_raw(
    store: EventStore, url: str, stream_id: str, type_: str, schema_version: int, data_json: str
) -> int:
    """A row with a valid chain that the store itself would refuse to write (unknown type, bad payload...)."""
    last = list(store.read_stream(stream_id))
    version, prev = (last[-1].stream_version, last[-1].hash) if last else (-1, GENESIS_HASH)
    position = store.head() + 1
    event_id, metadata = str(uuid.uuid4()), "{}"
    digest = chain_hash(prev, stream_id, version + 1, event_id, type_, schema_version, data_json, metadata)
    engine = create_engine(url)
    cast = "CAST(:d AS json)" if url.startswith("postgresql") else ":d"
    meta = "CAST(:m AS json)" if url.startswith("postgresql") else ":m"
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO events (position, stream_id, stream_version, event_id, type, schema_version, data, "
                    f"metadata, recorded_at, prev_hash, hash) VALUES (:p, :s, :v, :e, :t, :sv, {cast}, {meta}, 0, "
                    ":ph, :h)"
                ),
                {
                    "p": position,
                    "s": stream_id,
                    "v": version + 1,
                    "e": event_id,
                    "t": type_,
                    "sv": schema_version,
                    "d": data_json,
                    "m": metadata,
                    "ph": prev,
                    "h": digest,
                },
            )
    finally:
        engine.dispose()
    return position


def rehash_stream(url: str, store: EventStore, stream_id: str) -> None:
    """Recomputes the chain of a whole stream over its (edited) rows, as a careful tamperer would."""
    prev = GENESIS_HASH
    for ev in store.read_stream(stream_id):
        digest = chain_hash(
            prev,
            ev.stream_id,
            ev.stream_version,
            ev.event_id,
            ev.type,
            ev.schema_version,
            ev.data_json,
            ev.metadata_json,
        )
        if digest != ev.hash or prev != ev.prev_hash:
            _run_without_trigger(
                url,
                "UPDATE events SET prev_hash = :ph, hash = :h WHERE position = :p",
                {"ph": prev, "h": digest, "p": ev.position},
            )
        prev = digest
