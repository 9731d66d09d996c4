"""Gap-free tailing under concurrent writers, and all-or-nothing appends under SIGKILL."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from eventstore import open_store
from eventstore.events import AttemptMinted


def minted(i: int, group: str) -> AttemptMinted:
    return AttemptMinted(rollout_id=f"{group}_g{i}", generation_index=i)


def test_tailing_reader_never_passes_a_held_transaction(pg_url: str) -> None:
    """Writer A holds its append open; B and C append meanwhile; the reader must not skip A's event."""
    from eventstore import upgrade_database

    upgrade_database(pg_url)
    store = open_store(pg_url)
    store.append("group-a", [minted(0, "a")])
    sub = store.subscribe("tailer")
    assert [e.position for e in sub.poll()] == [1]

    a_appended, release_a = threading.Event(), threading.Event()

    def writer_a() -> None:
        with store.transaction() as tx:
            tx.append("group-a", [minted(1, "a")])
            a_appended.set()
            release_a.wait(10)

    others_done: list[int] = []

    def writer(group: str) -> None:
        others_done.extend(store.append(f"group-{group}", [minted(0, group)]).positions)

    ta = threading.Thread(target=writer_a)
    ta.start()
    assert a_appended.wait(10)
    tb = threading.Thread(target=writer, args=("b",))
    tc = threading.Thread(target=writer, args=("c",))
    tb.start()
    tc.start()
    time.sleep(0.5)
    # While A is open nothing after position 1 is visible, and B/C have not slipped in before it.
    assert sub.poll() == []
    assert store.head() == 1
    assert others_done == []
    release_a.set()
    for t in (ta, tb, tc):
        t.join(10)
    delivered = [e for e in sub.follow(idle_timeout_s=0.5)]
    assert [e.position for e in delivered] == [2, 3, 4]
    assert delivered[0].stream_id == "group-a"  # A's held event is delivered, first, exactly once
    assert sorted(others_done) == [3, 4]


def _writer_process(url: str, writer: int, appends: int, batch: int) -> None:
    store = open_store(url)
    for n in range(appends):
        store.append(f"group-w{writer}", [minted(n * batch + i, f"w{writer}") for i in range(batch)])
    store.close()


@pytest.mark.slow
def test_eight_writer_processes_and_one_tailer_see_every_event_once_in_order(pg_url: str) -> None:
    from eventstore import upgrade_database

    upgrade_database(pg_url)
    writers, appends, batch = 8, 60, 3
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer_process, args=(pg_url, w, appends, batch)) for w in range(writers)]
    store = open_store(pg_url)
    sub = store.subscribe("stress-tailer", from_position=0)
    for p in procs:
        p.start()
    seen: list[int] = []
    ids: set[str] = set()
    per_stream: dict[str, list[int]] = {}
    total = writers * appends * batch
    deadline = time.monotonic() + 120
    while len(seen) < total and time.monotonic() < deadline:
        for ev in sub.poll():
            seen.append(ev.position)
            ids.add(ev.event_id)
            per_stream.setdefault(ev.stream_id, []).append(ev.stream_version)
        time.sleep(0.005)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert seen == list(range(1, total + 1))  # every event, once, in position order, no gap
    assert len(ids) == total
    assert all(v == list(range(appends * batch)) for v in per_stream.values())
    assert store.verify_chain() is None


CRASH_WRITER = textwrap.dedent(
    """
    import sys
    from eventstore import open_store
    from eventstore.events import AttemptMinted
    store = open_store(sys.argv[1])
    n = 0
    while True:
        store.append("group-crash", [AttemptMinted(rollout_id=f"c_g{n + i}", generation_index=n + i) for i in range(400)])
        n += 400
        if n == 400:
            print("ready", flush=True)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("kill_after_s", [0.3, 0.7, 1.1])
def test_sigkill_mid_append_leaves_all_or_none(store_url: str, kill_after_s: float) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", CRASH_WRITER, store_url], stdout=subprocess.PIPE, env={**os.environ}
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    time.sleep(kill_after_s)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    store = open_store(store_url)
    count = sum(1 for _ in store.read_all())
    assert count >= 400 and count % 400 == 0, f"{count} events: a batch was partly written"
    assert store.head() == count
    assert store.verify_chain() is None
    # the log is still writable after the crash
    assert store.append("group-crash", [minted(count, "c")]).positions == [count + 1]


def test_database_restart_and_outage_are_survived_without_a_manual_step() -> None:
    from eventstore import DatabaseUnavailable, upgrade_database
    from eventstore.testing import PgCluster

    with PgCluster() as cluster:
        url = cluster.url(cluster.create_database("outage")).replace("postgres@", "postgres:pw@")
        upgrade_database(url)
        store = open_store(url)
        store.append("group-o", [minted(0, "o")])
        cluster.restart()  # every pooled connection is now dead
        assert store.append("group-o", [minted(1, "o")]).positions == [2]
        cluster.pg_ctl("stop", "-m", "fast")
        with pytest.raises(DatabaseUnavailable) as err:
            store.append("group-o", [minted(2, "o")])
        assert "pw" not in str(err.value) and "***" in str(err.value)
        with pytest.raises(DatabaseUnavailable):
            list(store.read_all())
        cluster.pg_ctl("start")
        assert [e.stream_version for e in store.read_all()] == [0, 1]
        assert store.append("group-o", [minted(2, "o")]).positions == [3]
        assert store.verify_chain() is None


def test_the_group_commits_own_session_is_replaced_when_the_server_ends_it(pg_url: str) -> None:
    """Group writes share one held session; a server that ends it between two appends costs the
    next append nothing, and closing the store ends the session."""
    import psycopg

    from eventstore import upgrade_database

    upgrade_database(pg_url)
    store = open_store(pg_url)
    store.append("group-s", [minted(0, "s")])
    dsn = pg_url.replace("postgresql+psycopg://", "postgresql://")

    def sessions() -> list[int]:
        with psycopg.connect(dsn, autocommit=True) as admin:
            rows = admin.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                "AND application_name = 'ledger' AND query LIKE '%ledger_append_events%'"
            ).fetchall()
        return [pid for (pid,) in rows]

    (first,) = sessions()
    with psycopg.connect(dsn, autocommit=True) as admin:
        assert admin.execute("SELECT pg_terminate_backend(%s)", (first,)).fetchone() == (True,)
        deadline = time.monotonic() + 30  # gate: the backend has ended (its FATAL is on the socket)
        while admin.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (first,)).fetchone() != (
            0,
        ):
            assert time.monotonic() < deadline, "the terminated session never ended"
            time.sleep(0.01)
    assert store.append("group-s", [minted(1, "s")]).positions == [2]
    (second,) = sessions()
    assert second != first
    store.close()
    with psycopg.connect(dsn, autocommit=True) as admin:
        assert admin.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (second,)
        ).fetchone() == (0,)
    assert open_store(pg_url).verify_chain() is None
