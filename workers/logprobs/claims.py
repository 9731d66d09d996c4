"""The work queue of the logprob workers: rows of `work_leases`, filled from the log, claimed by lease.

One row per (sealed try, policy version):

* `work_key`  = `"<rollout_id>/<attempt_index>/<policy_version>"`; the `LogprobsComputed` (or
  `LogprobsRefused`) event id is `uuid5(namespace, work_key)`, so the log itself refuses a second result
  for the same try and policy whatever happens to this table;
* `kind`      = `"logprobs:<policy_version>"`: workers running another policy never claim this row;
* `source_position` = the position of the try's `SiblingSealed` (the worker reads the receipt there);
* `owner`, `expires_at` = the lease; `done` = its result is in the log.

Enqueue is a catch-up subscription (`logprobs-enqueue:<policy_version>`): each pass reads the
`SiblingSealed` events after the stored position up to the head, inserts their rows with
`ON CONFLICT DO NOTHING` and stores the new position in the same transaction.  Positions are gap-free
(see `eventstore.backends`), so advancing to the head never skips a seal that commits later; two workers
enqueueing at once insert the same keys and one of them does nothing.

Claiming takes the oldest open rows whose lease has expired and gives them to this worker for
`lease_s` seconds.  On PostgreSQL the `SELECT ... FOR UPDATE SKIP LOCKED` lets many workers on many hosts
claim at once without waiting on each other's rows; lease times come from the database clock, so hosts
with skewed clocks agree on when a lease ends.  On SQLite the writer's `BEGIN IMMEDIATE` makes the claim
atomic (one worker per database file is the supported set-up; a second one on the same host is safe but
gains nothing).  A worker that dies keeps its rows only until the lease expires; then they are claimed
again, and because the result append and `done = TRUE` share one transaction, a dead worker leaves either
both or neither.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from itertools import islice

from sqlalchemy import Connection, bindparam, text

from eventstore import EventStore
from eventstore.events import SiblingSealed

# Fixed forever: changing it would change every event id and let a try be scored twice.
LOGPROBS_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "rollout-ledger/logprobs-computed")
ENQUEUE_BATCH = 5000


def work_key(rollout_id: str, attempt_index: int, policy_version: str) -> str:
    return f"{rollout_id}/{attempt_index}/{policy_version}"


def result_event_id(rollout_id: str, attempt_index: int, policy_version: str) -> uuid.UUID:
    """The id of the one result event (computed or refused) of a try under a policy version."""
    return uuid.uuid5(LOGPROBS_NAMESPACE, work_key(rollout_id, attempt_index, policy_version))


def work_kind(policy_version: str) -> str:
    return f"logprobs:{policy_version}"


@dataclass(frozen=True, slots=True)
class Claim:
    work_key: str
    source_position: int


@dataclass(frozen=True, slots=True)
class QueueCounts:
    total: int
    done: int
    claimable: int
    # Seconds until the earliest lease held by someone else ends (None: no such lease).
    next_expiry_s: float | None

    @property
    def open(self) -> int:
        return self.total - self.done


_INSERT = text(
    "INSERT INTO work_leases (work_key, kind, source_position, owner, expires_at, done) "
    "VALUES (:key, :kind, :position, NULL, 0, FALSE) ON CONFLICT (work_key) DO NOTHING"
)
_SELECT_OPEN = (
    "SELECT work_key, source_position FROM work_leases "
    "WHERE kind = :kind AND NOT done AND expires_at < :now ORDER BY source_position LIMIT :n"
)
_TAKE = text(
    "UPDATE work_leases SET owner = :owner, expires_at = :expires WHERE work_key IN :keys"
).bindparams(bindparam("keys", expanding=True))
_DONE = text("UPDATE work_leases SET done = TRUE, owner = :owner WHERE work_key = :key")
_RELEASE = text(
    "UPDATE work_leases SET expires_at = 0 WHERE owner = :owner AND NOT done AND work_key IN :keys"
).bindparams(bindparam("keys", expanding=True))
_RECORDED = text("SELECT event_id FROM events WHERE event_id IN :ids").bindparams(
    bindparam("ids", expanding=True)
)


class LeaseBoard:
    """The `work_leases` rows of one policy version, seen by one worker (`owner`)."""

    def __init__(self, store: EventStore, policy_version: str, owner: str, lease_s: float = 60.0) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.store = store
        self.policy_version = policy_version
        self.kind = work_kind(policy_version)
        self.owner = owner
        self.lease_s = lease_s
        self.subscription = f"logprobs-enqueue:{policy_version}"

    def now(self, conn: Connection) -> float:
        """The lease clock: the database's on PostgreSQL (shared by every host), ours on SQLite (one host)."""
        return self.store.recorder.clock(conn)

    # --- filling -----------------------------------------------------------

    def enqueue(self, limit: int = ENQUEUE_BATCH) -> int:
        """Adds a row for every try sealed since the last pass; returns how many seals it read."""
        after = self.store.subscriber_position(self.subscription)
        head = self.store.head()
        if head <= after:
            return 0
        seals = list(
            islice(self.store.read_all(after, to_position=head, types={SiblingSealed.event_type()}), limit)
        )
        # A full batch stops at its last seal; otherwise every position up to the head has been seen.
        upto = seals[-1].position if len(seals) == limit else head
        rows = []
        for recorded in seals:
            data = recorded.data
            key = work_key(str(data["rollout_id"]), int(data["attempt_index"]), self.policy_version)
            rows.append({"key": key, "kind": self.kind, "position": recorded.position})
        with self.store.transaction() as tx:
            if rows:
                tx.connection.execute(_INSERT, rows)
            tx.save_position(self.subscription, upto)
        return len(rows)

    # --- claiming ----------------------------------------------------------

    def claim(self, n: int) -> list[Claim]:
        """Up to `n` open rows whose lease has expired, now leased to this worker.

        Rows whose result is already in the log (a worker that committed, then lost this table's
        update to a restore, say) are marked done here instead of being scored again.
        """
        if n < 1:
            raise ValueError(f"claim size must be >= 1, got {n}")
        while True:
            with self.store.transaction() as tx:
                conn = tx.connection
                now = self.now(conn)
                select = _SELECT_OPEN + self.store.recorder.lock_rows_clause()
                rows = conn.execute(text(select), {"kind": self.kind, "now": now, "n": n}).all()
                if not rows:
                    return []
                claims = [Claim(str(r[0]), int(r[1])) for r in rows]
                ids = {str(uuid.uuid5(LOGPROBS_NAMESPACE, c.work_key)): c for c in claims}
                recorded = {str(r[0]) for r in conn.execute(_RECORDED, {"ids": list(ids)}).all()}
                for event_id in recorded:
                    conn.execute(_DONE, {"owner": self.owner, "key": ids[event_id].work_key})
                fresh = [c for i, c in ids.items() if i not in recorded]
                if fresh:
                    conn.execute(
                        _TAKE,
                        {
                            "owner": self.owner,
                            "expires": now + self.lease_s,
                            "keys": [c.work_key for c in fresh],
                        },
                    )
            if fresh:
                return sorted(fresh, key=lambda c: c.source_position)
            # Every row taken was already done in the log; look again.

    def mark_done(self, conn: Connection, key: str) -> None:
        """Inside the transaction that appends the result: the row is done exactly when the event exists."""
        conn.execute(_DONE, {"owner": self.owner, "key": key})

    def release(self, keys: list[str]) -> None:
        """Gives unfinished claims back at once (a worker stopping cleanly), instead of at lease expiry."""
        if keys:
            with self.store.transaction() as tx:
                tx.connection.execute(_RELEASE, {"owner": self.owner, "keys": keys})

    # --- watching ----------------------------------------------------------

    def counts(self) -> QueueCounts:
        with self.store.transaction() as tx:
            conn = tx.connection
            now = self.now(conn)
            row = conn.execute(
                text(
                    "SELECT COUNT(*), "
                    "COALESCE(SUM(CASE WHEN done THEN 1 ELSE 0 END), 0), "
                    "COALESCE(SUM(CASE WHEN NOT done AND expires_at < :now THEN 1 ELSE 0 END), 0), "
                    "MIN(CASE WHEN NOT done AND expires_at >= :now THEN expires_at END) "
                    "FROM work_leases WHERE kind = :kind"
                ),
                {"kind": self.kind, "now": now},
            ).one()
        next_expiry = None if row[3] is None else max(0.0, float(row[3]) - now)
        return QueueCounts(int(row[0]), int(row[1]), int(row[2]), next_expiry)
