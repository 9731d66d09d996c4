"""The store's benchmarks, end to end at a small scale on a real PostgreSQL.

Their speed is not checked here (speed is what running them measures); what is checked is that each
runs every case and that the rows each system wrote are what it claims to write: the ledger's log
and the floor benchmark's two hand-chained copies all verify link by link.
"""

from __future__ import annotations

import math

import psycopg

from benchmarks import append_floor, eventstore
from eventstore import open_store
from eventstore.records import GENESIS_HASH, chain_hash


def _assert_chained(dsn: str, table: str) -> int:
    """Every stream of `table` chains from the genesis hash, as `chain_hash` recomputes it."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT stream_id, stream_version, event_id, type, schema_version, data::text, metadata::text, "
            f"prev_hash, hash FROM {table} ORDER BY stream_id, stream_version"
        ).fetchall()
    last: dict[str, tuple[int, str]] = {}
    for stream, version, event_id, type_, schema_version, data, metadata, prev_hash, hash_ in rows:
        expected_version, expected_prev = last.get(stream, (-1, GENESIS_HASH))
        assert (version, prev_hash) == (expected_version + 1, expected_prev), (table, stream, version)
        assert hash_ == chain_hash(
            prev_hash, stream, version, event_id, type_, schema_version, data, metadata
        )
        last[stream] = (version, hash_)
    return len(rows)


def test_the_store_benchmark_runs_every_case_and_its_log_verifies(pg_url: str) -> None:
    results = eventstore.run(pg_url, appends=20, replay_events=2_000, writers=2, rounds=1)
    assert tuple(results) == eventstore.KEYS
    for case in results.values():
        assert set(case) == {"ledger", "raw", "eventsourcing"}
        assert all(math.isfinite(rate) and rate > 0 for rate in case.values())
    store = open_store(pg_url)
    assert store.head() > 2_000 and store.verify_chain() is None


def test_the_floor_benchmark_runs_every_row_and_chains_like_the_store(pg_url: str) -> None:
    medians = append_floor.run(pg_url, appends=10, rounds=1)
    assert list(medians) == [
        "floor",
        "floor + lock, heads and chain in SQL",
        "ledger_append_events, arguments ready",
        "ledger (EventStore.append)",
        "eventsourcing",
    ]
    for rates in medians.values():
        assert set(rates) == set(append_floor.PER_APPEND)
        assert all(math.isfinite(rate) and rate > 0 for rate in rates.values())
    # warm-up and one round, at 1 and at 10 events per append
    written = (20 + 10) * 1 + (20 + 10) * 10
    assert _assert_chained(eventstore.dsn_of(pg_url), "floor_events") == written
    assert _assert_chained(eventstore.dsn_of(pg_url), "chain_events") == written
    assert (
        _assert_chained(eventstore.dsn_of(pg_url), "events") == 2 * written
    )  # the function's row and the store's
    assert open_store(pg_url).verify_chain() is None


def test_the_store_benchmark_on_sqlite_runs_every_case_against_raw_sqlite3() -> None:
    """`--sqlite`: the append cases and a journal batch on the embedded default, each beside raw
    sqlite3, with both sides' CPU per event."""
    results = eventstore.run_sqlite(appends=48, writers=2, rounds=1)
    assert list(results) == ["append_1", "append_10", "append_8x1", "batch_8x3"]
    for case in results.values():
        assert set(case) == {"ledger", "raw", "ledger_cpu_us", "raw_cpu_us"}
        assert all(math.isfinite(v) and v > 0 for v in (case["ledger"], case["raw"]))
        assert all(math.isfinite(v) and v >= 0 for v in (case["ledger_cpu_us"], case["raw_cpu_us"]))
