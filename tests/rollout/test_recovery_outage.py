"""A connection killed while a recovering coordinator folds the log is ridden out like any outage.

The fault is real: a PostgreSQL backend ended by `pg_terminate_backend` in the middle of the query it
runs for the recovery.  What makes it land there is a gate, not timing: the test holds an exclusive
lock on `events`, lets the recovery's query start and wait on it, ends that backend, and only then
lets go (`_killed_mid_query`).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import psycopg

from eventstore import DatabaseUnavailable, EventStore, open_store, upgrade_database
from protocol.streams import group_stream, is_group_stream
from tests.rollout.conftest import PAYLOAD, PROMPT, MakeAgent, coordinator, gid
from trainer import RolloutCoordinator
from trainer.gym import GymClient

_T = TypeVar("_T")

_BLOCKED = (
    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND application_name = 'ledger' "
    "AND wait_event_type = 'Lock' AND query LIKE '%events%'"
)
_GONE = "SELECT count(*) FROM pg_stat_activity WHERE pid = %s"


def _killed_mid_query(dsn: str, call: Callable[[], _T]) -> _T:
    """Runs `call` (one query of the store's) while the test holds `events` locked: once the query
    waits on the lock, its backend is terminated, then the lock released.  Raises what `call` raises."""
    locked = threading.Event()
    problems: list[str] = []

    def admin() -> None:
        # The lock is held by one transaction until its rollback; the watching is done on a session of
        # its own (a transaction sees pg_stat_activity as it was when it first looked).
        with psycopg.connect(dsn) as holder, psycopg.connect(dsn, autocommit=True) as watcher:
            holder.execute("LOCK TABLE events IN ACCESS EXCLUSIVE MODE")
            locked.set()
            try:
                deadline = time.monotonic() + 60  # a bound, not a speed: the query is on its way
                while not (pids := [pid for (pid,) in watcher.execute(_BLOCKED).fetchall()]):
                    if time.monotonic() > deadline:
                        problems.append("no query of the store waited on the lock")
                        return
                    time.sleep(0.005)
                (pid,) = pids
                watcher.execute("SELECT pg_terminate_backend(%s)", (pid,))
                while watcher.execute(_GONE, (pid,)).fetchone() != (0,):
                    if time.monotonic() > deadline:
                        problems.append("the terminated backend never ended")
                        return
                    time.sleep(0.005)
            finally:
                holder.rollback()

    thread = threading.Thread(target=admin, name="pg-admin")
    thread.start()
    try:
        assert locked.wait(60), "the lock on events was never had"
        return call()
    finally:
        thread.join(60)
        assert not problems, problems


class _Gates:
    """The first call of each read the journal makes of `store` (the fold's page read, a stream's
    version) loses its connection mid-query; every call is counted by the stream it reads."""

    def __init__(self, store: EventStore, dsn: str) -> None:
        self.killed: Counter[str] = Counter()
        self.group_versions_read = 0
        read_all, stream_version = store.read_all, store.stream_version

        def gated_read_all(*args: Any, **kwargs: Any) -> Iterator[Any]:
            pages = read_all(*args, **kwargs)
            if not self.killed["read_all"]:
                self.killed["read_all"] += 1
                yield _killed_mid_query(dsn, lambda: next(pages))
            yield from pages

        def gated_stream_version(stream_id: str) -> int:
            if is_group_stream(stream_id):
                self.group_versions_read += 1
            if not self.killed["stream_version"]:
                self.killed["stream_version"] += 1
                return _killed_mid_query(dsn, lambda: stream_version(stream_id))
            return stream_version(stream_id)

        store.read_all = gated_read_all  # type: ignore[method-assign]
        store.stream_version = gated_stream_version  # type: ignore[method-assign]


async def test_recovery_rides_out_a_connection_killed_during_its_fold(
    pg_url: str, make_agent: MakeAgent
) -> None:
    """Issue: the fold was ridden out, but each archived group's stream version was read after it,
    one round trip per group and outside the outage budget, so one terminated backend there made
    `recover(..., outage_budget_s=30)` raise `DatabaseUnavailable` at once.  Now the versions come
    from the fold itself: no read per group, and a killed fold page is retried where it broke off."""
    upgrade_database(pg_url)
    dsn = pg_url.replace("postgresql+psycopg://", "postgresql://")
    agent = make_agent("a")
    first, again = open_store(pg_url), open_store(pg_url)
    try:
        async with GymClient(agent.url, "a") as client:
            groups = [gid("fold") for _ in range(4)]
            async with coordinator(first, {"a": client}, mode="sibling", trainer_id="T") as coord:
                for g in groups:
                    await coord.submit(g, PROMPT, "a", 2, PAYLOAD)
                async for sealed in coord.sealed_groups():
                    await coord.claim_for_training(sealed.group_id, 0)
                await coord.wait_idle(60)
                # A claimed group is archived one checkpoint after the one that holds its claim.
                for _ in range(2):
                    assert (await coord.checkpoint(gid("ck"))).outcome == "committed"
                assert set(groups) <= coord.ledger.archived.keys()

            gates = _Gates(again, dsn)
            recovered = await RolloutCoordinator.recover(
                again, {"a": client}, mode="sibling", trainer_id="T", outage_budget_s=30
            )
            try:
                assert gates.killed["read_all"] == 1 and recovered.journal_figures()["outage_retries"] >= 1
                assert gates.group_versions_read == 0, "a round trip per archived group"
                assert set(groups) <= recovered.ledger.archived.keys()
                # The fencing tokens it adopted are the log's, archived groups' included.
                for g in groups:
                    stream = group_stream(g)
                    assert recovered._journal.versions[stream] == first.stream_version(stream)
                # And it goes on writing: a new group runs, is claimed and checkpointed.
                late = gid("fold")
                await recovered.submit(late, PROMPT, "a", 2, PAYLOAD)
                async for sealed in recovered.sealed_groups():
                    await recovered.claim_for_training(sealed.group_id, 1)
                await recovered.wait_idle(60)
                for _ in range(2):
                    assert (await recovered.checkpoint(gid("ck"))).outcome == "committed"
                assert late in recovered.ledger.archived
            finally:
                await recovered.close()
    finally:
        first.close()
        again.close()


def test_the_gate_kills_a_query_for_real(pg_url: str) -> None:
    """The gate itself: the query it lets start is ended by the server, and the store says so."""
    upgrade_database(pg_url)
    store = open_store(pg_url)
    try:
        dsn = pg_url.replace("postgresql+psycopg://", "postgresql://")
        try:
            _killed_mid_query(dsn, lambda: store.stream_version("group-x"))
        except DatabaseUnavailable:
            pass
        else:
            raise AssertionError("the query survived its backend")
        assert store.stream_version("group-x") == -1  # the next call reconnects
    finally:
        store.close()
