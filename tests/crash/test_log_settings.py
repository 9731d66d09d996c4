"""The settings the SQLite log runs with (docs/operations.md, What a power cut can lose): WAL and
`synchronous=FULL` unless the URL says `?synchronous=normal` or `extra`; `off`, which can leave the
file corrupt after a power cut, is refused in one line and no file is made."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import text

from eventstore import upgrade_database
from eventstore.backends import create_engines

LEDGER = str(Path(sys.executable).with_name("ledger"))


@pytest.mark.parametrize(
    ("query", "expected"), [("", 2), ("?synchronous=normal", 1), ("?synchronous=EXTRA", 3)]
)
def test_the_log_runs_in_wal_mode_with_the_synchronous_setting_of_its_url(
    tmp_path: Path, query: str, expected: int
) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}{query}"
    upgrade_database(url)
    writer, reader = create_engines(url)
    try:
        with writer.connect() as conn:
            assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
            assert conn.execute(text("PRAGMA synchronous")).scalar() == expected
    finally:
        writer.dispose()
        reader.dispose()


def test_synchronous_off_is_refused_in_one_line(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}?synchronous=off"
    done = subprocess.run([LEDGER, "db", "upgrade", "--db", url], capture_output=True, text=True, check=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert (
        done.stderr.startswith("error: synchronous='off' is not a setting of the log")
        and done.stderr.count("\n") == 1
    )
    assert not (tmp_path / "ledger.db").exists()
