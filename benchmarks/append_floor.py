"""Where one writer's durable append spends its time: the floor of the log's table and each layer
above it, beside the `eventsourcing` library.

    python -m benchmarks.append_floor [--db URL] [--appends N] [--rounds 5]

Every row appends `--appends` appends of 1 and then of 10 events, one after another, each committed
(fsync on) before the next starts, on one server in one process; the rows take turns round after
round and each reports its median.  The rows, cheapest first:

- floor: one prepared INSERT of the rows into a copy of `events` (the same columns and indexes),
  positions, versions and chained hashes all supplied by the client (it is the only writer): no
  lock, no read, no check on the server.  The least a durable append to this table costs.
- floor + lock, heads and chain in SQL: the log-wide advisory lock, then one statement (both in one
  round trip, one pipeline) that reads the log's and the stream's heads, chains the hashes with a
  recursive CTE and inserts: the append's server work in plain SQL, without its checks.
- ledger_append_events, arguments ready: the store's function as the store calls it, its arguments
  rendered before the clock starts (the server's and the driver's share of an append).
- ledger: `EventStore.append`, everything included.
- eventsourcing: the library's PostgreSQL application recorder (the baseline of issue 17's goal).

Without `--db` a throwaway PostgreSQL cluster is started (default settings, fsync on).
"""

from __future__ import annotations

import argparse
import statistics
import uuid
from typing import Any

import psycopg
from rich.console import Console
from rich.table import Table

from benchmarks.eventstore import EventSourcing, Ours, database, dsn_of, payload, sequential
from eventstore import upgrade_database
from eventstore.postgres import _APPEND_EVENTS, _events_params
from eventstore.records import GENESIS_HASH, UNIT_SEPARATOR, ExpectedVersion, chain_hash
from eventstore.store import _checked

console = Console(width=150)
PER_APPEND = (1, 10)

_ROWS = (
    "SELECT u.id, u.t, u.v::int AS sv, u.d, u.m, u.o FROM unnest("
    "string_to_array(%(ids)s, chr(31)), string_to_array(%(types)s, chr(31)), string_to_array(%(versions)s, chr(31)), "
    "string_to_array(%(data)s, chr(31)), string_to_array(%(metadata)s, chr(31))) WITH ORDINALITY AS u(id, t, v, d, m, o)"
)
FLOOR_INSERT = (
    f"WITH a AS ({_ROWS}) INSERT INTO floor_events SELECT %(position)s + a.o, %(streams)s, %(version)s + a.o, "
    "a.id, a.t, a.sv, a.d::json, a.m::json, %(recorded_at)s, "
    "split_part(%(prev_hashes)s, chr(31), a.o::int), split_part(%(hashes)s, chr(31), a.o::int) FROM a"
)
SQL_LOCK = "SELECT pg_advisory_xact_lock(2021093)"
SQL_CHAIN_INSERT = f"""
WITH RECURSIVE a AS ({_ROWS}),
head AS (
    SELECT COALESCE((SELECT max(position) FROM chain_events), 0) AS pos, COALESCE(h.stream_version, -1) AS ver,
           COALESCE(h.hash, repeat('0', 64)) AS hash
    FROM (SELECT 1) one LEFT JOIN LATERAL (
        SELECT stream_version, hash FROM chain_events WHERE stream_id = %(streams)s
        ORDER BY stream_version DESC LIMIT 1) h ON true),
c(o, h) AS (
    SELECT 0::bigint, (SELECT hash FROM head)
    UNION ALL
    SELECT c.o + 1, encode(sha256(convert_to(concat_ws(chr(31), c.h, %(streams)s::text,
        ((SELECT ver FROM head) + c.o + 1)::text, a.id, a.t, a.sv::text, a.d, a.m), 'UTF8')), 'hex')
    FROM c JOIN a ON a.o = c.o + 1)
INSERT INTO chain_events
SELECT head.pos + a.o, %(streams)s, head.ver + a.o, a.id, a.t, a.sv, a.d::json, a.m::json, %(recorded_at)s, p.h, c.h
FROM a JOIN c ON c.o = a.o JOIN c p ON p.o = a.o - 1 CROSS JOIN head
RETURNING position, stream_version, prev_hash, hash
"""


def rendered(stream: str, first: int, per_append: int) -> dict[str, Any]:
    """One append's arguments as the store renders them (`_checked`, `_events_params`)."""
    events = [payload(first + i) for i in range(per_append)]
    params = _events_params([_checked(stream, events, ExpectedVersion.ANY, None, None)])
    params.update(blob_digests=None, blobs=None, notify=False, independent=True)
    return params


class Layer:
    """A row of the table on its own autocommit session: `inputs` renders each append's arguments
    (before the clock), `write` sends them."""

    def __init__(self, dsn: str) -> None:
        self.conn = psycopg.connect(dsn, autocommit=True, options="-c enable_seqscan=off")
        self.cursor = self.conn.cursor()

    def inputs(self, appends: int, per_append: int) -> list[dict[str, Any]]:
        run = uuid.uuid4().hex[:6]
        return [
            rendered(f"{type(self).__name__}-{run}-{a % 64}", a * per_append, per_append)
            for a in range(appends)
        ]

    def write(self, inputs: list[dict[str, Any]]) -> int:
        for params in inputs:
            self.write_one(params)
        return sum(int(params["counts"]) for params in inputs)  # one append each

    def write_one(self, params: dict[str, Any]) -> None:
        raise NotImplementedError


class Floor(Layer):
    def __init__(self, dsn: str) -> None:
        super().__init__(dsn)
        self.conn.execute("CREATE TABLE floor_events (LIKE events INCLUDING ALL)")
        self.position = 0
        self.heads: dict[str, tuple[int, str]] = {}

    def inputs(self, appends: int, per_append: int) -> list[dict[str, Any]]:
        batch = super().inputs(appends, per_append)
        for params in batch:  # the chain as only a sole writer can know it: from its own last append
            stream = params["streams"]
            version, prev = self.heads.get(stream, (-1, GENESIS_HASH))
            prevs, hashes = [], []
            columns = (
                params[k].split(UNIT_SEPARATOR) for k in ("ids", "types", "versions", "data", "metadata")
            )
            fields = zip(*columns, strict=True)
            for event_id, type_, schema_version, data, metadata in fields:
                version += 1
                prevs.append(prev)
                prev = chain_hash(prev, stream, version, event_id, type_, int(schema_version), data, metadata)
                hashes.append(prev)
            params.update(
                position=self.position,
                version=version - per_append,
                prev_hashes=UNIT_SEPARATOR.join(prevs),
                hashes=UNIT_SEPARATOR.join(hashes),
            )
            self.position += per_append
            self.heads[stream] = (version, prev)
        return batch

    def write_one(self, params: dict[str, Any]) -> None:
        self.cursor.execute(FLOOR_INSERT, params, prepare=True)


class SqlChain(Layer):
    def __init__(self, dsn: str) -> None:
        super().__init__(dsn)
        self.conn.execute("CREATE TABLE chain_events (LIKE events INCLUDING ALL)")

    def write_one(self, params: dict[str, Any]) -> None:
        with self.conn.pipeline():
            self.cursor.execute(SQL_LOCK, prepare=True)
            self.cursor.execute(SQL_CHAIN_INSERT, params, prepare=True)
        self.cursor.fetchall()


class FunctionReady(Layer):
    def write_one(self, params: dict[str, Any]) -> None:
        self.cursor.execute(_APPEND_EVENTS, params)
        self.cursor.fetchall()


def run(url: str, appends: int, rounds: int) -> dict[str, dict[int, float]]:
    """Median events/s of every row at 1 and at 10 events per append."""
    upgrade_database(url)
    dsn = dsn_of(url)
    rows: dict[str, Any] = {
        "floor": Floor(dsn),
        "floor + lock, heads and chain in SQL": SqlChain(dsn),
        "ledger_append_events, arguments ready": FunctionReady(dsn),
        "ledger (EventStore.append)": Ours(url),
        "eventsourcing": EventSourcing(url, 1),
    }
    medians: dict[str, dict[int, float]] = {name: {} for name in rows}
    for per_append in PER_APPEND:
        with console.status(f"{per_append} event(s) per append"):
            for system in rows.values():  # connections, plans and caches warm
                sequential(system, 20, per_append)
            rates: dict[str, list[float]] = {name: [] for name in rows}
            for _ in range(rounds):
                for name, system in rows.items():
                    rates[name].append(sequential(system, appends, per_append))
        for name, measured in rates.items():
            medians[name][per_append] = statistics.median(measured)
    return medians


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--db", help="PostgreSQL URL of an empty database (default: a throwaway cluster)")
    parser.add_argument("--appends", type=int, default=1000, help="appends per row and round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, the rows taking turns; medians")
    args = parser.parse_args(argv)
    with database(args.db, "floor") as url:
        medians = run(url, args.appends, args.rounds)
    table = Table(
        title=f"benchmarks.append_floor: one writer, medians of {args.rounds} rounds of {args.appends} appends"
    )
    table.add_column("row")
    for per_append in PER_APPEND:
        table.add_column(f"{per_append} ev/append: ev/s", justify="right")
        table.add_column("us/append", justify="right")
        table.add_column("/ eventsourcing", justify="right")
    baseline = medians["eventsourcing"]
    for name, rates in medians.items():
        cells = []
        for per_append in PER_APPEND:
            rate = rates[per_append]
            cells += [
                f"{rate:,.0f}",
                f"{per_append / rate * 1e6:,.0f}",
                f"{rate / baseline[per_append]:.2f}x",
            ]
        table.add_row(name, *cells)
    console.print(table)


if __name__ == "__main__":
    main()
