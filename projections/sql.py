"""The projections' own tables: projection checkpoints and subscriber positions, and the hashes of a range."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text

from eventstore import EventStore


def read_hashes(store: EventStore, after: int, to: int) -> list[str]:
    mark = store.recorder.positional_mark
    with store.read_connection() as conn:
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
    with store.read_connection() as conn:
        rows = conn.execute(text(query + " ORDER BY position, projection"), params).all()
    return [
        StoredCheckpoint(str(r[0]), int(r[1]), int(r[2]), str(r[3]), str(r[4]), float(r[5])) for r in rows
    ]


def load_checkpoint_state(store: EventStore, projection: str, version: int, position: int) -> str | None:
    column = store.recorder.json_text("state")
    with store.read_connection() as conn:
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
    state_param = store.recorder.json_param("state")
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
    with store.read_connection() as conn:
        rows = conn.execute(text("SELECT name, position FROM subscriptions")).all()
    return {str(r[0]): int(r[1]) for r in rows}
