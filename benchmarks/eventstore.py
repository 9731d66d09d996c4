"""Append and replay throughput of the store on PostgreSQL, beside its two baselines; with `--sqlite`,
its appends on the embedded default (SQLite) beside the standard library's sqlite3.

    python -m benchmarks.eventstore [--db URL] [--appends N] [--replay-events N] [--writers 8] [--rounds 3] [--json]
    python -m benchmarks.eventstore --sqlite [--appends N] [--writers 8] [--rounds 3]

With `--json` stdout is one JSON object, keys append_1, append_10, append_8x1, append_8x10 and replay,
each {"ledger": ev/s, "raw": ev/s, "eventsourcing": ev/s}; the table and the extra measurements
(rebuild of all projections, bulk against per-event decode, group commit sizes) go to stderr.

Without `--db` a throwaway PostgreSQL cluster is started (default settings,
fsync on).  Every case runs ours, raw psycopg on an equivalent table (the
ceiling), and the `eventsourcing` library's PostgreSQL recorder, in one run on
one server, and prints events/s with ratios: for the append cases the median of
`--rounds` rounds in which the three take turns.  An append case times the writing only: each
system's inputs are built before the clock starts (ours and raw psycopg get the typed events and
render them on the clock; eventsourcing gets its state already serialised).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sqlite3
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
from rich.console import Console
from rich.table import Table
from sqlalchemy.engine import make_url

from eventstore import open_store, upgrade_database
from eventstore.bulk_reads import fewer_collections
from eventstore.events import RunReplied
from eventstore.read_ahead import PAGE_SIZE
from eventstore.records import ExpectedVersion, canonical, decode_events, decode_in_bulk
from eventstore.testing import PgCluster
from projections.runner import rebuild

console = Console(width=120)
KEYS = ("append_1", "append_10", "append_8x1", "append_8x10", "replay")

RAW_TABLE = """
CREATE TABLE IF NOT EXISTS raw_events (
    position BIGSERIAL PRIMARY KEY, stream_id TEXT NOT NULL, stream_version BIGINT NOT NULL,
    event_id TEXT NOT NULL UNIQUE, type TEXT NOT NULL, data JSON NOT NULL,
    UNIQUE (stream_id, stream_version))
"""


def payload(i: int) -> RunReplied:
    return RunReplied(
        rollout_id=f"p{i}_g{i % 8}",
        attempt_index=0,
        reward=0.5,
        mask_sample=False,
        reply_digest="sha256:" + "ab" * 32,
    )


def dsn_of(url: str) -> str:
    """The libpq connection string of a SQLAlchemy PostgreSQL URL (raw psycopg's connections)."""
    u = make_url(url)
    dsn = f"host={u.host} port={u.port} user={u.username} dbname={u.database}"
    return dsn + (f" password={u.password}" if u.password else "")


def events(first: int, count: int) -> list[RunReplied]:
    return [payload(first + i) for i in range(count)]


def timed(fn: Callable[[], int]) -> float:
    """Events per second of `fn`, which returns how many events it wrote or read."""
    start = time.perf_counter()
    n = fn()
    return n / (time.perf_counter() - start)


class Ours:
    name = "ledger"

    def __init__(self, url: str, notify: bool = False) -> None:
        self.store = open_store(url, pool_size=10, notify=notify)
        self.run = uuid.uuid4().hex[:6]

    def inputs(self, appends: int, per_append: int, writer: int = 0) -> list[tuple[str, list[RunReplied]]]:
        """The typed events of each append, as an application hands them over."""
        return [
            (f"group-{self.run}-w{writer}-{a % 64}", events(a * per_append, per_append))
            for a in range(appends)
        ]

    def write(self, inputs: list[tuple[str, list[RunReplied]]]) -> int:
        for stream, batch in inputs:
            self.store.append(stream, batch)
        return sum(len(batch) for _, batch in inputs)

    def write_batch(self, inputs: list[tuple[str, list[RunReplied]]]) -> int:
        self.store.append_batch([(stream, batch, ExpectedVersion.ANY) for stream, batch in inputs])
        return sum(len(batch) for _, batch in inputs)

    def load(self, events: int) -> None:
        for start in range(0, events, 1000):
            self.store.append(
                f"group-load-{start // 1000}", [payload(start + i) for i in range(min(1000, events - start))]
            )

    def replay(self) -> int:
        """Typed replay: every event read and validated into its catalogue model."""
        n = 0
        for _ in self.store.read_typed():
            n += 1
        return n

    def rebuild(self) -> int:
        """Every default projection rebuilt from the whole log (no checkpoint)."""
        return rebuild(self.store, from_checkpoint=False).events

    def decode_rates(self) -> tuple[float, float]:
        """Per-event validation (`decode_events`) against one list validation per type and page."""
        pages = list(self.store.read_pages())
        n = sum(len(p) for p in pages)
        with fewer_collections():  # as replay runs them
            per_event = timed(lambda: sum(len(decode_events(p)[0]) for p in pages))
            bulk = timed(lambda: sum(len(decode_in_bulk(p)) for p in pages))
        assert n
        return per_event, bulk


class Raw:
    """The ceiling: plain INSERTs and SELECTs with psycopg, no lock, no hash, no validation."""

    name = "raw psycopg"

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(RAW_TABLE)
        self.versions: dict[str, int] = {}
        self.lock = threading.Lock()

    def inputs(self, appends: int, per_append: int, writer: int = 0) -> list[tuple[str, list[RunReplied]]]:
        run = uuid.uuid4().hex[:6]
        return [(f"raw-{run}-w{writer}-{a % 64}", events(a * per_append, per_append)) for a in range(appends)]

    def write(self, inputs: list[tuple[str, list[RunReplied]]]) -> int:
        """Each append: its rows rendered (the same canonical JSON as ours), one executemany, commit."""
        with psycopg.connect(self.dsn) as conn:
            for stream, batch in inputs:
                base = self.versions.get(stream, -1)
                rows = [
                    (
                        stream,
                        base + 1 + i,
                        str(uuid.uuid4()),
                        "RunReplied",
                        canonical(e.model_dump(mode="json")),
                    )
                    for i, e in enumerate(batch)
                ]
                self.versions[stream] = base + len(batch)
                with conn.cursor() as cur:
                    cur.executemany(
                        "INSERT INTO raw_events (stream_id, stream_version, event_id, type, data) "
                        "VALUES (%s, %s, %s, %s, %s)",
                        rows,
                    )
                conn.commit()
        return sum(len(batch) for _, batch in inputs)

    def load(self, events: int) -> None:
        with psycopg.connect(self.dsn) as conn, conn.cursor() as cur:
            data = canonical(payload(0).model_dump(mode="json"))
            with cur.copy(
                "COPY raw_events (stream_id, stream_version, event_id, type, data) FROM STDIN"
            ) as copy:
                for i in range(events):
                    copy.write_row((f"load-{i // 1000}", i % 1000, str(uuid.uuid4()), "RunReplied", data))
            conn.commit()

    def replay(self) -> int:
        n, after = 0, 0
        with psycopg.connect(self.dsn) as conn:
            while True:
                rows = conn.execute(
                    "SELECT position, stream_id, stream_version, event_id, type, data::text FROM raw_events "
                    "WHERE position > %s ORDER BY position LIMIT %s",
                    (after, PAGE_SIZE),
                ).fetchall()
                n += len(rows)
                if len(rows) < PAGE_SIZE:
                    return n
                after = rows[-1][0]


class RawSqlite:
    """The embedded floor: plain INSERTs with the standard library's sqlite3 into an equivalent table, in
    the log's own settings (WAL, `synchronous=FULL`), one `BEGIN IMMEDIATE` transaction per append (per
    batch in `write_batch`): no head read, no hash, no validation."""

    name = "raw sqlite3"

    def __init__(self, path: str) -> None:
        self.conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=FULL")
        self.conn.execute(
            "CREATE TABLE IF NOT EXISTS raw_events (position INTEGER PRIMARY KEY, stream_id TEXT NOT NULL, "
            "stream_version INTEGER NOT NULL, event_id TEXT NOT NULL UNIQUE, type TEXT NOT NULL, "
            "data TEXT NOT NULL, UNIQUE (stream_id, stream_version))"
        )
        self.versions: dict[str, int] = {}
        self.lock = threading.Lock()

    def inputs(self, appends: int, per_append: int, writer: int = 0) -> list[tuple[str, list[RunReplied]]]:
        run = uuid.uuid4().hex[:6]
        return [(f"raw-{run}-w{writer}-{a % 64}", events(a * per_append, per_append)) for a in range(appends)]

    def _rows(self, stream: str, batch: list[RunReplied]) -> list[tuple[Any, ...]]:
        base = self.versions.get(stream, -1)
        self.versions[stream] = base + len(batch)
        return [
            (stream, base + 1 + i, str(uuid.uuid4()), "RunReplied", canonical(e.model_dump(mode="json")))
            for i, e in enumerate(batch)
        ]

    def _commit(self, rows: list[tuple[Any, ...]]) -> None:
        with self.lock:  # one connection: its writers take turns, as SQLite's one writer does
            self.conn.execute("BEGIN IMMEDIATE")
            self.conn.executemany(
                "INSERT INTO raw_events (stream_id, stream_version, event_id, type, data) VALUES (?, ?, ?, ?, ?)",
                rows,
            )
            self.conn.execute("COMMIT")

    def write(self, inputs: list[tuple[str, list[RunReplied]]]) -> int:
        for stream, batch in inputs:
            self._commit(self._rows(stream, batch))
        return sum(len(batch) for _, batch in inputs)

    def write_batch(self, inputs: list[tuple[str, list[RunReplied]]]) -> int:
        self._commit([row for stream, batch in inputs for row in self._rows(stream, batch)])
        return sum(len(batch) for _, batch in inputs)


def batched(system: Any, batches: int, appends: int, per_append: int) -> float:
    """Events/s of one writer committing `appends` appends at a time (the trainer journal's group
    commit: `EventStore.append_batch`), inputs built before the clock starts."""
    inputs = [system.inputs(appends, per_append) for _ in range(batches)]
    return timed(lambda: sum(system.write_batch(part) for part in inputs))


def run_sqlite(appends: int, writers: int, rounds: int) -> dict[str, dict[str, float]]:
    """The append cases on a SQLite log (the embedded default) against raw sqlite3."""
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/log.db"
        upgrade_database(url)
        ours, raw = Ours(url), RawSqlite(f"{tmp}/raw.db")
        per_writer = max(appends // writers, 50)
        cases: list[tuple[str, str, Callable[[Any], float]]] = [
            ("append_1", "append, 1 event per append", lambda s: sequential(s, appends, 1)),
            ("append_10", "append, 10 events per append", lambda s: sequential(s, appends // 2, 10)),
            ("append_8x1", f"append, {writers} concurrent writers x 1 event", lambda s: concurrent(s, writers, per_writer, 1)),
            ("batch_8x3", "a journal batch: 8 appends of 3 events, one commit", lambda s: batched(s, appends // 8, 8, 3)),
        ]  # fmt: skip
        results: dict[str, dict[str, float]] = {}
        table = Table(
            title=f"benchmarks.eventstore on SQLite (WAL, synchronous=FULL; medians of {rounds} rounds; "
            "CPU: the process's, every thread, per event)"
        )
        for col in ("case", "ledger ev/s", "raw sqlite3 ev/s", "ledger / raw", "ledger CPU us", "raw CPU us"):
            table.add_column(col, justify="right" if col != "case" else "left")
        systems: tuple[Any, ...] = (ours, raw)
        counts = {
            "append_1": appends,
            "append_10": appends // 2 * 10,
            "append_8x1": writers * per_writer,
            "batch_8x3": appends // 8 * 24,
        }
        for key, label, case in cases:
            with console.status(label):
                for system in systems:
                    sequential(system, 20, 1)
                runs: list[list[float]] = [[], []]
                cpu: list[list[float]] = [[], []]
                for _ in range(rounds):
                    for i, system in enumerate(systems):
                        started = time.process_time()
                        runs[i].append(case(system))
                        cpu[i].append(time.process_time() - started)
                a, b = (statistics.median(r) for r in runs)
                ca, cb = (1e6 * statistics.median(c) / counts[key] for c in cpu)
            results[key] = {
                "ledger": round(a),
                "raw": round(b),
                "ledger_cpu_us": round(ca),
                "raw_cpu_us": round(cb),
            }
            table.add_row(label, f"{a:,.0f}", f"{b:,.0f}", f"{a / b:.2f}x", f"{ca:,.0f}", f"{cb:,.0f}")
        console.print(table)
        ours.store.close()
        raw.conn.close()
    return results


class EventSourcing:
    """The `eventsourcing` library's PostgreSQL application recorder (9.5.x)."""

    name = "eventsourcing"

    def __init__(self, url: str, writers: int) -> None:
        from eventsourcing.postgres import PostgresApplicationRecorder, PostgresDatastore

        u = make_url(url)
        self.datastore = PostgresDatastore(
            dbname=u.database or "postgres",
            host=u.host or "127.0.0.1",
            port=u.port or 5432,
            user=u.username or "postgres",
            password=u.password or "",
            pool_size=writers,
            max_overflow=writers,
        )
        self.recorder = PostgresApplicationRecorder(self.datastore, events_table_name="es_events")
        self.recorder.create_table()
        self.state = canonical(payload(0).model_dump(mode="json")).encode()

    def inputs(self, appends: int, per_append: int, writer: int = 0) -> list[tuple[uuid.UUID, int]]:
        """Each append's aggregate and event count; the state it stores is serialised once, here,
        outside the clock (its application would serialise every event: a head start we give it)."""
        ids = [uuid.uuid4() for _ in range(64)]
        return [(ids[a % 64], per_append) for a in range(appends)]

    def write(self, inputs: list[tuple[uuid.UUID, int]]) -> int:
        from eventsourcing.persistence import StoredEvent

        versions: dict[uuid.UUID, int] = {}
        for oid, count in inputs:
            base = versions.get(oid, 0)
            self.recorder.insert_events(
                [StoredEvent(oid, base + 1 + i, "RunReplied", self.state) for i in range(count)]
            )
            versions[oid] = base + count
        return sum(count for _, count in inputs)

    def load(self, events: int) -> None:
        from eventsourcing.persistence import StoredEvent

        for start in range(0, events, 1000):
            oid = uuid.uuid4()
            count = min(1000, events - start)
            self.recorder.insert_events(
                [StoredEvent(oid, i + 1, "RunReplied", self.state) for i in range(count)]
            )

    def replay(self) -> int:
        n, start = 0, 1
        while True:
            batch = self.recorder.select_notifications(start, PAGE_SIZE)
            n += len(batch)
            if len(batch) < PAGE_SIZE:
                return n
            start = batch[-1].id + 1


def settle(dsn: str) -> None:
    """The three logs as a long-lived log is read: vacuumed (hint bits and visibility map set, as
    autovacuum leaves them) and checkpointed (no bulk load still being flushed under the replays).
    Without it the first replay paid for the loads' background writes: 290k-306k events/s for ours
    against 314k-330k on a settled log (separate runs)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")
        # --db as a role that may not checkpoint: vacuumed still.
        with contextlib.suppress(psycopg.errors.InsufficientPrivilege):
            conn.execute("CHECKPOINT")


def sequential(system: Any, appends: int, per_append: int) -> float:
    """Events/s of one writer; its inputs are built before the clock starts."""
    inputs = system.inputs(appends, per_append)
    return timed(lambda: system.write(inputs))


def concurrent(system: Any, writers: int, appends: int, per_append: int) -> float:
    """Events/s of `writers` threads appending at once, from when all of them have their inputs
    built until the last one is done."""
    ready = threading.Barrier(writers + 1)

    def writer(w: int) -> None:
        inputs = system.inputs(appends, per_append, w)
        ready.wait()
        system.write(inputs)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    ready.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    return writers * appends * per_append / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--db", help="PostgreSQL URL of an empty database (default: a throwaway cluster)")
    parser.add_argument("--appends", type=int, default=2000, help="appends per append case")
    parser.add_argument("--replay-events", type=int, default=1_000_000)
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds of each append case, the systems alternating; medians"
    )
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    parser.add_argument(
        "--sqlite", action="store_true", help="the append cases on a SQLite log against raw sqlite3 instead"
    )
    args = parser.parse_args(argv)
    global console
    if args.json:
        console = Console(stderr=True, width=120)
    if args.sqlite:
        results = run_sqlite(args.appends, args.writers, args.rounds)
        if args.json:
            print(json.dumps(results))
        return

    with database(args.db, "bench") as url:
        results = run(url, args.appends, args.replay_events, args.writers, args.rounds)
    if args.json:
        print(json.dumps(results))


@contextlib.contextmanager
def database(url: str | None, name: str) -> Iterator[str]:
    """`url` (`--db`), or an empty database `name` in a throwaway cluster, stopped on the way out."""
    if url is not None:
        yield url
        return
    with PgCluster() as cluster:
        yield cluster.url(cluster.create_database(name))


def run(
    url: str, appends: int, replay_events: int, writers: int, rounds: int = 3
) -> dict[str, dict[str, float]]:
    dsn = dsn_of(url)
    upgrade_database(url)
    ours, raw, es = Ours(url), Raw(dsn), EventSourcing(url, writers)
    rows: list[tuple[str, float, float, float]] = []
    per_writer = max(appends // writers, 50)
    cases: list[tuple[str, Callable[[Any], float]]] = [
        ("append, 1 event per append", lambda s: sequential(s, appends, 1)),
        ("append, 10 events per append", lambda s: sequential(s, appends // 2, 10)),
        (f"append, {writers} concurrent writers x 1 event", lambda s: concurrent(s, writers, per_writer, 1)),
        (
            f"append, {writers} concurrent writers x 10 events",
            lambda s: concurrent(s, writers, per_writer // 2, 10),
        ),
    ]
    systems: tuple[Any, ...] = (ours, raw, es)
    for label, case in cases:
        with console.status(label):
            for system in systems:  # warm up connections and plans
                sequential(system, 20, 1)
            # The systems take turns, round after round, and each keeps its median: a noisy moment of
            # the machine lands on one round of one system, not on one system's only measurement.
            runs: list[list[float]] = [[], [], []]
            for _ in range(rounds):
                for i, system in enumerate(systems):
                    runs[i].append(case(system))
            rates = [statistics.median(r) for r in runs]
            rows.append((label, rates[0], rates[1], rates[2]))
    with console.status("NOTIFY on the append path"):
        notifying = Ours(url, notify=True)
        notify_rate = sequential(notifying, appends, 1)
        plain_rate = sequential(ours, appends, 1)
    with console.status(f"loading {replay_events:,} events into each log"):
        for system in (ours, raw, es):
            system.load(replay_events)
        settle(dsn)
    with console.status("replay"):
        rows.append(
            (
                "replay: read (ours: + decode to typed events)",
                timed(ours.replay),
                timed(raw.replay),
                timed(es.replay),
            )
        )
    with console.status("rebuild of every projection, and decode alone"):
        rebuild_rate = timed(ours.rebuild)
        per_event, bulk = ours.decode_rates()

    table = Table(
        title=f"benchmarks.eventstore on PostgreSQL ({replay_events:,}-event replay, {appends} appends, "
        f"medians of {rounds} rounds)"
    )
    for col in (
        "case",
        "ledger ev/s",
        "raw psycopg ev/s",
        "eventsourcing ev/s",
        "ledger / raw",
        "ledger / eventsourcing",
    ):
        table.add_column(col, justify="right" if col != "case" else "left")
    for label, a, b, c in rows:
        table.add_row(label, f"{a:,.0f}", f"{b:,.0f}", f"{c:,.0f}", f"{a / b:.2f}x", f"{a / c:.2f}x")
    console.print(table)
    console.print(
        f"NOTIFY on every append: {notify_rate:,.0f} ev/s vs {plain_rate:,.0f} ev/s without "
        f"({notify_rate / plain_rate:.2f}x) -- kept off the append path; subscribers poll."
    )
    stats = ours.store.group_commit.stats
    console.print(
        f"rebuild of every projection: {rebuild_rate:,.0f} ev/s; decode alone: per event "
        f"{per_event:,.0f} ev/s, one list validation per type and page {bulk:,.0f} ev/s; "
        f"group commit: {stats.appends:,} appends in {stats.writes:,} writes (largest {stats.largest})"
    )
    return {
        key: {"ledger": round(a), "raw": round(b), "eventsourcing": round(c)}
        for key, (_, a, b, c) in zip(KEYS, rows, strict=True)
    }


if __name__ == "__main__":
    main()
