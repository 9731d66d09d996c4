"""A PostgreSQL that answers and refuses the connection (a wrong password, a database that does not
exist) is no outage: every command that opens a log, and the payload plane's PostgreSQL store, fails
at once in one line saying it was refused and not retried (a payload store's refusal was ridden out for
the 30 s outage budget, then reported as the store being unavailable).  Real subprocesses of the real
CLI against a throwaway cluster that asks for passwords."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from eventstore import upgrade_database
from eventstore.testing import PgCluster

ROLE, PASSWORD = "ledger_app", "right"
BOUND_S = 120.0  # far above a refusal; reached only if it is waited out


@pytest.fixture(scope="module")
def cluster() -> Iterator[PgCluster]:
    """The superuser trusted on loopback (the fixtures' own connections), `ROLE` by password."""
    with PgCluster() as cluster:
        (cluster.data / "pg_hba.conf").write_text(
            "local all all trust\n"
            "host all postgres 127.0.0.1/32 trust\n"
            "host all all 127.0.0.1/32 scram-sha-256\n"
        )
        cluster.pg_ctl("reload")
        with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
            conn.execute(f"CREATE ROLE {ROLE} LOGIN SUPERUSER PASSWORD '{PASSWORD}'")
        yield cluster


def _ledger(tmp_path: Path, *args: str, payloads: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LEDGER_DB", "LEDGER_PAYLOADS")}
    env["COLUMNS"] = "200"
    if payloads is not None:
        env["LEDGER_PAYLOADS"] = payloads
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=BOUND_S,
        check=False,
    )


COMMANDS = [
    ["audit"],
    ["status"],
    ["db", "upgrade"],
    ["db", "current"],
    ["payloads", "prune"],
    ["simulate", "--groups", "1", "--siblings", "1", "--faults", ""],
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c[:2]))
@pytest.mark.parametrize("refusal", ["wrong-password", "no-such-database"])
def test_a_refused_log_connection_is_one_line_at_once(
    cluster: PgCluster, tmp_path: Path, command: list[str], refusal: str
) -> None:
    name = cluster.create_database()
    upgrade_database(cluster.url(name))  # a real log: only the connection is wrong
    if refusal == "wrong-password":
        url, says = cluster.url(name, ROLE, "wrong"), f'password authentication failed for user "{ROLE}"'
    else:
        url, says = (
            cluster.url(f"{name}_missing", ROLE, PASSWORD),
            f'database "{name}_missing" does not exist',
        )
    done = _ledger(tmp_path, *command, "--db", url)
    assert done.returncode == 2, done.stdout + done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith("error: database ") and "refused the connection (not retried)" in line, line
    assert says in line and "wrong" not in line  # the password is masked
    assert "Traceback" not in done.stdout + done.stderr


def test_a_payload_database_that_refuses_the_connection_stops_the_run_at_once(
    cluster: PgCluster, tmp_path: Path
) -> None:
    """The log is a SQLite file; the payloads go to a PostgreSQL with the wrong password.  The first put
    is refused for good: the run stops in one line naming --resume, without riding out the budget."""
    payloads = cluster.url(cluster.create_database(), ROLE, "wrong")
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    run = ["simulate", "--db", db, "--groups", "2", "--siblings", "1", "--faults", ""]
    done = _ledger(tmp_path, *run, payloads=payloads)
    assert done.returncode == 2, done.stdout + done.stderr
    [line] = [text for text in done.stderr.splitlines() if text.startswith("error:")]
    assert "the payload store refused to store payloads" in line, line
    assert "the database refused the connection (not retried)" in line and "password authentication" in line
    assert "unavailable for more than" not in line and "--resume " in line, line
    assert "Traceback" not in done.stdout + done.stderr
