"""The least a durable record of a run's rollouts costs, beside what the log's own layers cost for
the same rows: how much of a tiny rollout's trainer CPU is the durability the protocol asks for.

    python -m benchmarks.durable_floor [--groups 150] [--per-commit 1 4 12] [--rounds 3] [--log PATH]

A run of `ledger simulate` (the embedded default, the reference agents, no faults, no checkpoints;
or the log at `--log` and the payload directory beside it) gives the rows: every event it
appended and every payload it stored, in log order.  They are written again, a commit at a time,
each commit holding `--per-commit` rollouts' worth of rows and payloads (the run's own events and
payloads a rollout, times that), two ways:

- floor: Python's `sqlite3` on a fresh copy of the `events` table (its columns, keys and index;
  WAL, `synchronous=FULL`), each row's chained hash computed as the log computes it, one
  `executemany` and one commit; the commit's payloads in one batch file (written, fsync'd, its
  directory fsync'd) and then each renamed into place unsynced: the payload store's group commit
  without its checks.  No reads, no decisions, no objects: the durable writes themselves.
- the log's layers: `EventStore.append_batch` of the commit's rows as the trainer's journal hands
  them over (stream by stream, each event's JSON text and chosen id, the batch's metadata shared:
  the store's checks, its reads of the heads and ids, the SQLite writer)
  and `LocalDirPayloadStore.put_many` of the same payloads, on a fresh log and directory.

Each figure is the process's CPU (user + system, `getrusage`) over the writes, per rollout; the
rows take turns round after round and each reports its median.  The trainer's own figure to set
them beside is `benchmarks.peer`'s (a whole run: HTTP, decisions, projections, the training read).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from benchmarks.rollout_sizes import positive
from eventstore import open_store
from eventstore.records import GENESIS_HASH, ExpectedVersion, NewEvent, chain_hash
from participant.durable import sync_directory
from payloads import LocalDirPayloadStore

SEALED = "SiblingSealed"
_COLUMNS = "stream_id, stream_version, event_id, type, schema_version, data, metadata"
_TABLE = """CREATE TABLE events (
    position INTEGER PRIMARY KEY, stream_id TEXT NOT NULL, stream_version INTEGER NOT NULL,
    event_id TEXT NOT NULL UNIQUE, type TEXT NOT NULL, schema_version INTEGER NOT NULL,
    data TEXT NOT NULL, metadata TEXT NOT NULL, recorded_at REAL NOT NULL, prev_hash TEXT NOT NULL,
    hash TEXT NOT NULL, UNIQUE (stream_id, stream_version))"""
_INDEX = "CREATE INDEX events_type_position ON events (type, position)"
_INSERT = (
    "INSERT INTO events (stream_id, stream_version, event_id, type, schema_version, data, metadata, "
    "recorded_at, prev_hash, hash) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)

Row = tuple[str, int, str, str, int, str, str]


@dataclass(frozen=True)
class Source:
    """A run's rows in log order, its payloads (digest, bytes) and how many rollouts it sealed."""

    rows: list[Row]
    payloads: list[tuple[str, bytes]]
    rollouts: int

    def commits(self, per_commit: int) -> Iterator[tuple[list[Row], list[tuple[str, bytes]]]]:
        """The rows and payloads in commits of `per_commit` rollouts' worth each, in order."""
        rows_each = max(1, round(len(self.rows) * per_commit / self.rollouts))
        payloads_each = max(1, round(len(self.payloads) * per_commit / self.rollouts))
        r = p = 0
        while r < len(self.rows) or p < len(self.payloads):
            yield self.rows[r : r + rows_each], self.payloads[p : p + payloads_each]
            r, p = r + rows_each, p + payloads_each


def run_once(root: Path, groups: int) -> Path:
    """`ledger simulate` of `groups` groups into `root/ledger.db`; the log's path."""
    log = root / "ledger.db"
    argv = [sys.executable, "-m", "cli.main", "simulate", "--db", f"sqlite:///{log}", "--groups", str(groups)]
    argv += ["--faults", "", "--checkpoint-every", "0"]
    subprocess.run(argv, cwd=root, check=True, stdout=subprocess.DEVNULL, timeout=1800)
    return log


def read_source(log: Path) -> Source:
    """The rows of the log at `log` and the payload files beside it (`<log>.payloads`)."""
    try:
        with sqlite3.connect(f"file:{log}?mode=ro", uri=True) as db:
            rows: list[Row] = db.execute(f"SELECT {_COLUMNS} FROM events ORDER BY position").fetchall()
    except sqlite3.Error as exc:
        raise SystemExit(f"durable_floor: {log} is not a ledger's SQLite log: {exc}") from None
    sealed = sum(1 for row in rows if row[3] == SEALED)
    if not sealed:
        raise SystemExit(f"durable_floor: {log} holds no sealed rollout")
    payloads = []
    for path in sorted(Path(f"{log}.payloads").glob("sha256/*/*")):
        if len(path.name) == 64:  # a payload file (its name its digest), not a temporary one
            payloads.append((f"sha256:{path.name}", path.read_bytes()))
    return Source(rows, payloads, sealed)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def floor(source: Source, per_commit: int, root: Path) -> float:
    """The raw writes; CPU seconds."""
    db = sqlite3.connect(root / "log.db", isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute(_TABLE)
    db.execute(_INDEX)
    batches = root / "payloads" / "batches"
    batches.mkdir(parents=True)
    for shard in range(256):
        (root / "payloads" / f"{shard:02x}").mkdir()
    heads: dict[str, str] = {}
    os.sync()  # what setting up (and the last way's clean-up) left dirty is not this way's to write
    began = _cpu()
    for rows, payloads in source.commits(per_commit):
        if payloads:
            batch = batches / uuid.uuid4().hex
            fd = os.open(batch, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.write(fd, json.dumps([[d, len(c)] for d, c in payloads]).encode() + b"\n")
                for _, content in payloads:
                    os.write(fd, content)
                os.fsync(fd)
            finally:
                os.close(fd)
            sync_directory(batches)
            for digest, content in payloads:
                hex_ = digest.partition(":")[2]
                assert hashlib.sha256(content).hexdigest() == hex_
                path = root / "payloads" / hex_[:2] / hex_
                tmp = path.with_name(f".{hex_}.tmp")
                tmp.write_bytes(content)
                tmp.replace(path)
        if rows:
            records = []
            for stream, version, event_id, type_, schema, data, metadata in rows:
                prev = heads.get(stream, GENESIS_HASH)
                hash_ = chain_hash(prev, stream, version, event_id, type_, schema, data, metadata)
                heads[stream] = hash_
                records.append((stream, version, event_id, type_, schema, data, metadata, 0.0, prev, hash_))
            db.execute("BEGIN IMMEDIATE")
            db.executemany(_INSERT, records)
            db.execute("COMMIT")
    used = _cpu() - began
    db.close()
    return used


def layers(source: Source, per_commit: int, root: Path) -> float:
    """The same writes through the log's and the payload store's own code; CPU seconds."""
    store = open_store(f"sqlite:///{root / 'log.db'}", migrate_schema=True)
    payload_store = LocalDirPayloadStore(root / "payloads")
    try:
        os.sync()  # as in `floor`
        began = _cpu()
        for rows, payloads in source.commits(per_commit):
            if payloads:
                payload_store.put_many(dict(payloads))
            appends: list[tuple[str, list[NewEvent], int]] = []
            for stream, version, event_id, type_, schema, data, _ in rows:
                # As the trainer's journal gives them: the JSON text its typed event wrote, its id
                # chosen, the batch's metadata shared.
                event = NewEvent(type_, {}, event_id, schema_version=schema, validated_json=data)
                if appends and appends[-1][0] == stream:
                    appends[-1][1].append(event)
                else:
                    appends.append((stream, [event], version - 1 if version else ExpectedVersion.NO_STREAM))
            if appends:
                store.append_batch(appends, metadata=json.loads(rows[0][6]))
        return _cpu() - began
    finally:
        store.close()
        payload_store.close()


WAYS: dict[str, Callable[[Source, int, Path], float]] = {
    "floor (sqlite3, one batch file)": floor,
    "the log's layers (EventStore, LocalDirPayloadStore)": layers,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=positive, default=150, help="groups of the run that gives the rows")
    parser.add_argument("--per-commit", type=positive, nargs="+", default=[1, 4, 12], metavar="N")
    parser.add_argument("--rounds", type=positive, default=3)
    parser.add_argument("--log", type=Path, help="an existing run's SQLite log (its payloads beside it)")
    args = parser.parse_args(argv)
    if args.log is not None and not args.log.is_file():
        parser.error(f"--log: no SQLite log at {args.log}")
    with tempfile.TemporaryDirectory(prefix="durable-floor-") as tmp:
        log = args.log or run_once(Path(tmp), args.groups)
        source = read_source(log)
        figures: dict[tuple[str, int], list[float]] = {}
        for round_ in range(args.rounds):
            for name, way in WAYS.items():
                for k in args.per_commit:
                    root = Path(tempfile.mkdtemp(prefix=f"r{round_}-{k}-", dir=tmp))
                    figures.setdefault((name, k), []).append(1000 * way(source, k, root) / source.rollouts)
                    shutil.rmtree(root)
    table = Table(
        title=f"benchmarks.durable_floor: {source.rollouts} rollouts, {len(source.rows) / source.rollouts:.2f} "
        f"events and {len(source.payloads) / source.rollouts:.2f} payloads a rollout, medians of {args.rounds} rounds"
    )
    table.add_column("CPU a rollout, ms")
    for k in args.per_commit:
        table.add_column(f"{k} rollout{'s' if k > 1 else ''} a commit", justify="right")
    medians = {key: statistics.median(values) for key, values in figures.items()}
    for name in WAYS:
        table.add_row(name, *(f"{medians[(name, k)]:.3f}" for k in args.per_commit))
    names = list(WAYS)
    table.add_row(
        "layers / floor",
        *(f"{medians[(names[1], k)] / medians[(names[0], k)]:.2f}x" for k in args.per_commit),
    )
    Console().print(table)


if __name__ == "__main__":
    main()
