"""`ledger simulate` against a payload store that refuses: one line and exit status 2, nothing sealed
without its payload, and `--resume` finishes the run once the store is fixed.  Real subprocesses of
the real CLI, on a SQLite log and a local payload directory."""

from __future__ import annotations

import json
import os
import re
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


def _command(store: Path | str, *args: str) -> tuple[list[str], dict[str, str]]:
    """The `ledger` command line and its environment, its payloads in `store`."""
    return [sys.executable, "-m", "cli.main", *args], {
        **os.environ,
        "LEDGER_PAYLOADS": str(store),
        "COLUMNS": "200",
    }


def _ledger(tmp_path: Path, store: Path | str, *args: str) -> subprocess.CompletedProcess[str]:
    argv, env = _command(store, *args)
    return subprocess.run(
        argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RUN_BOUND_S, check=False
    )


def _resume_finishes(
    tmp_path: Path, store: Path | str, db: str, run_id: str, run: list[str], groups: int
) -> None:
    """`--resume` of the stopped run seals every group, none stranded or run twice, and the audit
    reads every payload the log claims back."""
    resumed = _ledger(tmp_path, store, "simulate", "--db", db, "--resume", run_id, "--json", *run)
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads(resumed.stdout)
    assert (summary["groups_sealed"], summary["stranded"], summary["duplicate_executions"]) == (groups, 0, 0)
    audit = _ledger(tmp_path, store, "audit", "--db", db, "--json")
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert json.loads(audit.stdout)["payloads"]["missing"] == 0


# The run's progress, a line every few seconds on a stderr that is not a terminal.
PROGRESS = re.compile(r"groups \d+/\d+ decided \(\d+ s\)")


def _stopped_in_one_line(returncode: int, stderr: str) -> tuple[str, str]:
    """A run the coordinator's stop ended: exit status 2, and on stderr, besides the progress lines,
    one `error:` line naming the run to `--resume` (the trainer's own log line of the stop left out);
    (that line, the run id)."""
    assert returncode == 2, stderr
    [line] = [text for text in stderr.splitlines() if not PROGRESS.fullmatch(text)]
    assert line.startswith("error: run ") and "; carry on with: ledger simulate --resume " in line, stderr
    return line, line.rsplit("--resume ", 1)[1]


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
    assert "Traceback" not in stopped.stdout
    line, run_id = _stopped_in_one_line(stopped.returncode, stopped.stderr)
    assert "the payload store refused to store payloads" in line and "Not a directory" in line, line
    log = open_store(db)
    try:
        types = {e.type for e in log.read_all()}
    finally:
        log.close()
    assert "SiblingSealed" not in types and "SiblingHeld" not in types  # nothing claims what was not kept

    (store / "sha256").unlink()
    _resume_finishes(tmp_path, store, db, run_id, RUN, 3)


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
        args = ["--groups", str(GROUPS), "--siblings", "2", "--checkpoint-every", "0", "--faults", ""]
        argv, env = _command(payload_url, "simulate", "--db", db, *args)
        run = subprocess.Popen(
            argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
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
        line, run_id = _stopped_in_one_line(run.returncode, stderr)
        assert "the payload store has been unavailable for more than 30 s" in line, line

        cluster.pg_ctl("start")
        _resume_finishes(tmp_path, payload_url, db, run_id, args, GROUPS)


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
