"""The projections' own reads and writes: lean event rows, projection checkpoints, subscriber positions.

Folding reads only the columns a projection uses (position, stream, version,
type, schema version, data, hash).  Skipping the metadata JSON and the ids
roughly halves the cost of a row, which is most of a replay's budget; the
rows come straight from the driver's cursor for the same reason.  Rows read
this way carry blank `event_id`, `metadata_json`, `recorded_at` and
`prev_hash`: a projection must not read them (the auditor, which does,
reads full rows through `EventStore.read_all`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, text

from eventstore import EventStore, RecordedEvent

# Constants stand in for the columns left out, so each row is a RecordedEvent's fields in order.
_LEAN = (
    "SELECT position, stream_id, stream_version, '' AS event_id, type, schema_version, {data}, "
    "'' AS metadata, {zero} AS recorded_at, '' AS prev_hash, hash FROM events"
)


def _reader(store: EventStore) -> Engine:
    # The store keeps its read-only engine private; projections are its one other reader.
    engine: Engine = store._reader
    return engine


def _marks(store: EventStore) -> str:
    return "?" if store.backend.name == "sqlite" else "%s"


def read_lean(
    store: EventStore, after: int = 0, to: int | None = None, batch_size: int = 5000
) -> Iterator[list[RecordedEvent]]:
    """Batches of events with `after < position <= to`, in position order, without metadata."""
    mark = _marks(store)
    sqlite = store.backend.name == "sqlite"
    columns = _LEAN.format(data="data" if sqlite else "data::text", zero="0.0" if sqlite else "0.0::float8")
    where = f"position > {mark}" + (f" AND position <= {mark}" if to is not None else "")
    query = f"{columns} WHERE {where} ORDER BY position LIMIT {int(batch_size)}"
    make = RecordedEvent._make
    raw = _reader(store).raw_connection()
    try:
        cursor = raw.cursor()
        while True:
            cursor.execute(query, (after, to) if to is not None else (after,))
            rows = cursor.fetchall()
            if not rows:
                return
            yield list(map(make, rows))
            if len(rows) < batch_size:
                return
            after = rows[-1][0]
            raw.commit()  # end the read transaction between batches: no snapshot pinned for a whole replay
    finally:
        raw.close()


def read_hashes(store: EventStore, after: int, to: int) -> list[str]:
    mark = _marks(store)
    with _reader(store).connect() as conn:
        rows = conn.exec_driver_sql(
            f"SELECT hash FROM events WHERE position > {mark} AND position <= {mark} ORDER BY position",
            (after, to),
        ).all()
    return [str(r[0]) for r in rows]


@dataclass(frozen=True, slots=True)
class StoredCheckpoint:
    projection: str
    version: int
    position: int
    state_hash: str
    log_digest: str
    created_at: float


def list_checkpoints(store: EventStore, projection: str | None = None) -> list[StoredCheckpoint]:
    """Every stored projection checkpoint (without its state), oldest first."""
    query = (
        "SELECT projection, version, position, state_hash, log_digest, created_at FROM projection_checkpoints"
    )
    params: dict[str, Any] = {}
    if projection is not None:
        query += " WHERE projection = :p"
        params["p"] = projection
    with _reader(store).connect() as conn:
        rows = conn.execute(text(query + " ORDER BY position, projection"), params).all()
    return [
        StoredCheckpoint(str(r[0]), int(r[1]), int(r[2]), str(r[3]), str(r[4]), float(r[5])) for r in rows
    ]


def load_checkpoint_state(store: EventStore, projection: str, version: int, position: int) -> str | None:
    column = "state" if store.backend.name == "sqlite" else "state::text"
    with _reader(store).connect() as conn:
        value = conn.execute(
            text(
                f"SELECT {column} FROM projection_checkpoints WHERE projection = :p AND version = :v AND position = :n"
            ),
            {"p": projection, "v": version, "n": position},
        ).scalar()
    return None if value is None else str(value)


def save_checkpoints(
    store: EventStore,
    rows: list[tuple[str, int, str, str]],
    position: int,
    log_digest: str,
    subscriber: str | None = None,
    keep: int | None = None,
) -> None:
    """Stores (projection, version, state JSON, state hash) rows at `position` in one transaction.

    With a subscriber name, its position is stored in the same transaction, so a
    restarted runner resumes exactly where its checkpoint says.  With `keep`,
    only the newest `keep` checkpoints of each projection stay.
    """
    state_param = "CAST(:state AS json)" if store.backend.name == "postgresql" else ":state"
    now = time.time()
    with store.transaction() as tx:
        conn = tx.connection
        for name, version, state_json, state_hash in rows:
            conn.execute(
                text(
                    "DELETE FROM projection_checkpoints WHERE projection = :p AND version = :v AND position = :n"
                ),
                {"p": name, "v": version, "n": position},
            )
            conn.execute(
                text(
                    "INSERT INTO projection_checkpoints (projection, version, position, state, state_hash, "
                    f"log_digest, created_at) VALUES (:p, :v, :n, {state_param}, :h, :d, :t)"
                ),
                {
                    "p": name,
                    "v": version,
                    "n": position,
                    "state": state_json,
                    "h": state_hash,
                    "d": log_digest,
                    "t": now,
                },
            )
            if keep is not None:
                conn.execute(
                    text(
                        "DELETE FROM projection_checkpoints WHERE projection = :p AND version = :v AND position < "
                        "(SELECT MIN(position) FROM (SELECT position FROM projection_checkpoints "
                        "WHERE projection = :p AND version = :v ORDER BY position DESC LIMIT :k) AS newest)"
                    ),
                    {"p": name, "v": version, "k": keep},
                )
        if subscriber is not None:
            tx.save_position(subscriber, position)


def subscriber_positions(store: EventStore) -> dict[str, int]:
    with _reader(store).connect() as conn:
        rows = conn.execute(text("SELECT name, position FROM subscriptions")).all()
    return {str(r[0]): int(r[1]) for r in rows}
