"""Concurrent workers: two share a PostgreSQL log; one killed (SIGKILL) mid-batch loses nothing."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import pytest
from sqlalchemy import text

from eventstore import EventStore, open_store, upgrade_database
from eventstore.events import LogprobsComputed
from tests.workers.test_worker import _array_blobs, assert_each_once, results
from tests.workers.tries import seal_group
from workers.logprobs import LogprobWorker, WorkerConfig, WorkerHooks, WorkerStats, result_event_id, work_key
from workers.policy import Policy, load_policy

ROOT = Path(__file__).resolve().parents[2]


def start_worker(args: dict[str, Any]) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.workers.worker_proc", json.dumps(args)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        bufsize=0,  # the pipe itself: `ProcessLines` keeps what it read past a line
    )


class ProcessLines:
    """The lines a process writes to a pipe (opened with `bufsize=0`), in order.

    The pipe's bytes are read and split into lines here, not by a buffered `readline`: one that took
    two lines off the pipe at once would keep the second in its buffer, where `select` never sees it,
    and the wait for it would end without it (what happened when the worker's `READY` and `HANG`
    lines arrived together on a loaded machine)."""

    def __init__(self, stream: IO[bytes] | None) -> None:
        assert stream is not None
        self._fd = stream.fileno()
        self._pending = b""

    def until(self, prefix: str, timeout_s: float = 300.0) -> str:
        """The next line that starts with `prefix`.  `timeout_s` bounds a process that hangs
        silently; it is no measure of speed."""
        deadline = time.monotonic() + timeout_s
        while True:
            while b"\n" in self._pending:
                raw, self._pending = self._pending.split(b"\n", 1)
                line = raw.decode(errors="replace").strip()
                if line.startswith(prefix):
                    return line
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._fd], [], [], left)[0]:
                raise AssertionError(f"no {prefix!r} within {timeout_s} s")
            chunk = os.read(self._fd, 65536)
            if not chunk:
                raise AssertionError(f"the process exited before printing {prefix!r}")
            self._pending += chunk


@pytest.fixture
def pg_store(pg_url: str) -> Iterator[EventStore]:
    upgrade_database(pg_url)
    store = open_store(pg_url)
    yield store
    store.close()


def test_two_workers_on_postgresql_share_the_work(pg_url: str, pg_store: EventStore, policy: Policy) -> None:
    """Two workers, each with its own store (engines, connections), race for the same 24 tries.

    Threads rather than processes: claims only meet in the database (FOR UPDATE SKIP LOCKED), so
    separate connections are what matters, and two more interpreters importing torch would cost
    more than the rest of this file on a small machine.  Process separation is exercised by the
    kill test below.
    """
    tries = [t for g in range(6) for t in seal_group(pg_store, policy, f"tw{g}", 4)]
    barrier = threading.Barrier(2)
    stats: dict[str, WorkerStats] = {}
    errors: list[BaseException] = []
    scored_a_batch = {name: threading.Event() for name in ("w0", "w1")}

    def after_batch(name: str) -> Callable[[object], None]:
        other = "w1" if name == "w0" else "w0"

        def hook(_: object) -> None:
            # The gate that keeps both in the race whatever the thread scheduling: after its first
            # batch a worker goes on only once the other has scored one too (a 50 ms pause per batch
            # was hoped to be enough for the other thread to get a claim in).
            scored_a_batch[name].set()
            scored_a_batch[other].wait(timeout=60)

        return hook

    def work(name: str) -> None:
        store = open_store(pg_url)
        try:
            worker = LogprobWorker(
                store,
                load_policy("tiny"),
                WorkerConfig(claim_size=2, poll_interval_s=0.05, backend="torch"),
                worker_id=name,
                hooks=WorkerHooks(after_batch=after_batch(name)),
            )
            barrier.wait(timeout=60)
            stats[name] = worker.run(once=True)
        except BaseException as exc:
            errors.append(exc)
        finally:
            store.close()

    threads = [threading.Thread(target=work, args=(f"w{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert sum(s.scored for s in stats.values()) == len(tries) == 24
    assert all(s.scored > 0 for s in stats.values()), stats  # the work was shared...
    assert all(s.duplicates == 0 for s in stats.values()), stats  # ...and no try was scored twice
    assert_each_once(pg_store, tries, policy.policy_version)
    writers = Counter(r.metadata["worker"] for r in pg_store.read_all(0, types={"LogprobsComputed"}))
    assert writers == Counter({name: s.scored for name, s in stats.items()})
    assert pg_store.verify_chain() is None


def test_two_lines_that_arrive_together_are_both_read(tmp_path: Path) -> None:
    """The wait for a worker's `HANG` line sees it also when it came in one read with `READY`."""
    written = tmp_path / "written"
    child = (
        "import sys, pathlib; sys.stdout.write('READY\\nHANG k/0/v\\n'); sys.stdout.flush(); "
        f"pathlib.Path({str(written)!r}).touch(); sys.stdin.read()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", child], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0
    )
    try:
        deadline = time.monotonic() + 60
        while not written.exists():  # gate: both lines are in the pipe before anything reads it
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.01)
        lines = ProcessLines(proc.stdout)
        assert lines.until("READY", timeout_s=5) == "READY"
        assert lines.until("HANG", timeout_s=5) == "HANG k/0/v"
    finally:
        proc.kill()
        proc.wait(10)


def test_a_worker_killed_mid_batch_leaves_no_partial_result(store_url: str, policy: Policy) -> None:
    store = open_store(store_url)
    try:
        tries = seal_group(store, policy, "kb", 3) + seal_group(store, policy, "kc", 3)
        # One batch of all six; it stops forever inside the third result's transaction (its array stored,
        # the event written, not committed) and is killed there.
        proc = start_worker({"url": store_url, "claim_size": 6, "lease_s": 0.5, "hang_at": 3})
        try:
            hung = ProcessLines(proc.stdout).until("HANG").split(" ", 1)[1]
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()

        done = results(store)
        # Two results in the log; the third array is stored but no event claims it (collection's to remove).
        assert len(done) == 2 and _array_blobs(store) == 3
        assert all(isinstance(e, LogprobsComputed) for e in done)
        assert len({e.blob_digest for e in done if isinstance(e, LogprobsComputed)}) == 2
        assert hung not in {work_key(e.rollout_id, e.attempt_index, e.policy_version) for e in done}
        with store.transaction() as tx:
            found = tx.connection.execute(text("SELECT work_key, done FROM work_leases")).all()
        rows = {str(r[0]): bool(r[1]) for r in found}
        assert sum(bool(v) for v in rows.values()) == 2 and not rows[hung]
        assert store.verify_chain() is None

        # Its claims come back when the lease ends; another worker finishes them, each once.
        stats = LogprobWorker(
            store, policy, WorkerConfig(claim_size=6, poll_interval_s=0.05, backend="torch")
        ).run(once=True)
        assert (stats.scored, stats.duplicates) == (4, 0)
        computed = assert_each_once(store, tries, policy.policy_version)
        assert len(computed) == 6 and _array_blobs(store) == 6
        rollout, attempt, version = hung.split("/")
        assert any(
            r.event_id == str(result_event_id(rollout, int(attempt), version))
            for r in store.read_all(0, types={"LogprobsComputed"})
        )
        assert store.verify_chain() is None
    finally:
        store.close()
