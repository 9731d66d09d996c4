"""`ledger simulate` against a payload store that refuses: one line and exit status 2, nothing sealed
without its payload, and `--resume` finishes the run once the store is fixed.  Real subprocesses of
the real CLI, on a SQLite log and a local payload directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from sqlalchemy import Engine, create_engine, text
from sqlalchemy.exc import ProgrammingError

from eventstore import open_store
from eventstore.testing import PgCluster
from payloads._postgres import TABLE

# Far above what these runs take; reached only if a run waits for ever (the fault under test).
RUN_BOUND_S = 240.0
# The run stopped mid-way: enough that its gate (the first payload stored) comes long before it ends.
GROUPS = 20
RUN = ["--groups", "3", "--siblings", "2", "--checkpoint-every", "0", "--faults", ""]


def _ledger(tmp_path: Path, store: Path | str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LEDGER_PAYLOADS": str(store), "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_BOUND_S,
        check=False,
    )


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def test_a_store_path_that_is_a_file_is_one_line_before_the_run(tmp_path: Path) -> None:
    target = tmp_path / "a-file"
    target.write_bytes(b"")
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    result = _ledger(tmp_path, target, "simulate", "--db", db, *RUN)
    assert result.returncode == 2, result.stderr
    assert _errors(result.stderr) == [f"error: payload store {target} is not a directory"], result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_a_store_that_refuses_every_put_stops_the_run_in_one_line_and_resume_finishes_it(
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"  # (not "payloads": `python -m` puts the cwd first on sys.path)
    store.mkdir()
    (store / "sha256").write_bytes(b"")  # where the store's shards go: every put is refused for good
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    stopped = _ledger(tmp_path, store, "simulate", "--db", db, *RUN)
    assert stopped.returncode == 2, stopped.stderr
    assert "Traceback" not in stopped.stderr + stopped.stdout
    [line] = _errors(stopped.stderr)
    assert "the payload store refused to store payloads" in line and "Not a directory" in line, line
    run_id = line.rsplit("--resume ", 1)[1]
    log = open_store(db)
    try:
        types = {e.type for e in log.read_all()}
    finally:
        log.close()
    assert "SiblingSealed" not in types and "SiblingHeld" not in types  # nothing claims what was not kept
    # The trainer's log says once why it stopped, not once per group.
    assert sum("stops:" in text for text in stopped.stderr.splitlines()) == 1, stopped.stderr

    (store / "sha256").unlink()
    resumed = _ledger(tmp_path, store, "simulate", "--db", db, "--resume", run_id, "--json", *RUN)
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads(resumed.stdout)
    assert (summary["groups_sealed"], summary["stranded"], summary["duplicate_executions"]) == (3, 0, 0)
    audit = _ledger(tmp_path, store, "audit", "--db", db, "--json")
    assert audit.returncode == 0, audit.stdout + audit.stderr


def test_a_payload_database_stopped_mid_run_stops_it_in_one_line_and_resume_finishes_it(
    tmp_path: Path,
) -> None:
    """The payloads live in a PostgreSQL of their own (the log is a SQLite file); it stops while the
    run is putting (the gate: the first payload row is there, with most of the run still to go).  The
    coordinator stops once its outage budget is spent, in one line; `--resume` finishes the run on the
    database restarted, and the audit reads every claimed payload back."""
    with PgCluster() as cluster:
        payload_url = cluster.url(cluster.create_database("payloads"))
        db = f"sqlite:///{tmp_path / 'ledger.db'}"
        env = {**os.environ, "LEDGER_PAYLOADS": payload_url, "COLUMNS": "200"}
        args = ["--groups", str(GROUPS), "--siblings", "2", "--checkpoint-every", "0", "--faults", ""]
        run = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "simulate", "--db", db, *args],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            engine = create_engine(payload_url)
            try:
                deadline = time.monotonic() + RUN_BOUND_S
                while not _has_rows(engine):
                    assert run.poll() is None and time.monotonic() < deadline, "no payload was ever put"
                    time.sleep(0.05)
            finally:
                engine.dispose()
            cluster.pg_ctl("stop", "-m", "immediate")
            _, stderr = run.communicate(timeout=RUN_BOUND_S)
        finally:
            if run.poll() is None:
                run.kill()
                run.wait()
        assert run.returncode == 2, stderr
        assert "Traceback" not in stderr
        [line] = _errors(stderr)
        assert "the payload store has been unavailable for more than 30 s" in line, line
        run_id = line.rsplit("--resume ", 1)[1]

        cluster.pg_ctl("start")
        resumed = subprocess.run(
            [sys.executable, "-m", "cli.main", "simulate", "--db", db, "--resume", run_id, "--json", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=RUN_BOUND_S,
            check=False,
        )
        assert resumed.returncode == 0, resumed.stderr
        summary = json.loads(resumed.stdout)
        assert (summary["groups_sealed"], summary["stranded"], summary["duplicate_executions"]) == (
            GROUPS,
            0,
            0,
        )
        audit = subprocess.run(
            [sys.executable, "-m", "cli.main", "audit", "--db", db, "--json"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=RUN_BOUND_S,
            check=False,
        )
        assert audit.returncode == 0, audit.stdout + audit.stderr
        assert json.loads(audit.stdout)["payloads"]["missing"] == 0


def _has_rows(engine: Engine) -> bool:
    try:
        with engine.connect() as conn:
            return bool(conn.execute(text(f"SELECT EXISTS (SELECT 1 FROM {TABLE})")).scalar())
    except ProgrammingError:  # the table is made by the first put
        return False


def test_a_memory_store_beside_a_log_on_disk_is_one_line_before_anything_is_submitted(tmp_path: Path) -> None:
    """The run would pass and every payload its log claims would be gone at exit."""
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    result = _ledger(tmp_path, "memory://", "simulate", "--db", db, *RUN)
    assert result.returncode == 2, result.stderr
    [line] = _errors(result.stderr)
    assert line.startswith("error: payload store 'memory://' keeps nothing past this process"), line
    assert "Traceback" not in result.stderr
    log = open_store(db)
    try:
        assert list(log.read_all()) == []
    finally:
        log.close()
