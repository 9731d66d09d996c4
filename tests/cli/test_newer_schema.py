"""A log written by a newer rollout-ledger (its `alembic_version` names a migration this code does not
know): every command, `ledger db upgrade` first, says so in one line and changes nothing.

Once every command said "Run `ledger db upgrade`", and that printed alembic's 266-line traceback (it
cannot locate the revision).  The commands run as a user runs them: the `ledger` script, in the
environment a user has; on SQLite and on PostgreSQL.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from eventstore import migrate
from tests.userenv import ledger_command, user_env

FUTURE = "9999_from_a_newer_ledger"


def stamp(url: str, revision: str) -> None:
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(text("UPDATE alembic_version SET version_num = :v"), {"v": revision})
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    "command",
    [
        ["db", "upgrade"],
        ["status"],
        ["simulate", "--groups", "1", "--siblings", "1", "--checkpoint-every", "0"],
    ],
    ids=lambda c: " ".join(c[:2]),
)
def test_a_log_from_a_newer_ledger_is_one_line_naming_the_package(
    store_url: str, tmp_path: Path, command: list[str]
) -> None:
    stamp(store_url, FUTURE)
    done = subprocess.run(
        [ledger_command(), *command, "--db", store_url],
        capture_output=True, text=True, cwd=tmp_path, env=user_env(COLUMNS="80"), timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    [line] = done.stderr.splitlines()
    assert line.startswith("error: database ") and f"is at migration '{FUTURE}'" in line, line
    assert "the log was written by a newer rollout-ledger; upgrade the rollout-ledger package" in line, line
    assert f"(its newest is '{migrate.head_revision()}')" in line and "ledger db upgrade" not in line, line
    assert "Traceback" not in done.stdout + done.stderr
    engine = create_engine(store_url)
    try:
        assert migrate.current_revision(engine) == FUTURE  # nothing changed
    finally:
        engine.dispose()
