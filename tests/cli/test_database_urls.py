"""A mistyped or unsupported `--db` is one line saying what to write; read-only commands open the log
read-only: they audit a file nobody may write, and never create a file at a mistyped path."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from eventstore import BadDatabaseUrl, EventStoreError, NoSuchLog, open_store
from eventstore.backends import check_url
from tests.projections.builder import LogBuilder

cli = CliRunner()


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("mysql://u:secret@host/db", "mysql:// is not a log this ledger can use"),
        ("http://127.0.0.1:8000", "http:// is not a log this ledger can use"),
        ("ledger.db", "for a SQLite file write sqlite:///ledger.db"),
        ("sqlite:/x", "sqlite:///RELATIVE/PATH or sqlite:////ABSOLUTE/PATH"),
        ("sqlite://", "names no file"),
        ("postgresql+psycopg2://u:secret@h/d", "write postgresql+psycopg://u:***@h/d"),
        ("postgresql://u:secret@h:notaport/d", "is not a database URL"),
    ],
)
@pytest.mark.parametrize(
    "command", [["audit"], ["status"], ["db", "upgrade"], ["db", "current"], ["simulate"]]
)
def test_a_bad_url_is_one_line_saying_what_to_write(
    url: str, says: str, command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    result = cli.invoke(app, [*command, "--db", url])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], result.output
    assert "secret" not in result.output and "Traceback" not in result.output
    assert list(tmp_path.iterdir()) == []  # nothing was created


def test_postgres_urls_name_psycopg() -> None:
    assert check_url("postgres://u:pw@h:5432/d") == "postgresql+psycopg://u:pw@h:5432/d"
    assert check_url("postgresql://u@h/d") == "postgresql+psycopg://u@h/d"
    assert check_url("postgresql+psycopg://u@h/d") == "postgresql+psycopg://u@h/d"
    with pytest.raises(BadDatabaseUrl):
        check_url("oracle://h/d")


def test_an_unreachable_postgresql_is_one_line(tmp_path: Path) -> None:
    result = cli.invoke(app, ["audit", "--db", "postgresql://u:secret@127.0.0.1:1/ledger"])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert "unavailable" in lines[0] and "secret" not in lines[0]


@pytest.mark.parametrize(
    "command",
    [
        ["audit"],
        ["status"],
        ["snapshot"],
        ["show", "p1_g0"],
        ["debt", "list"],
        ["tail"],
        ["db", "current"],
        # Commands that write to a log they expect (never one they would make): `replay` made an
        # empty file at a mistyped path before it found no schema there.
        ["replay"],
        ["debt", "drop", "p1_g0", "0", "--operator", "me", "--reason", "gone"],
        ["payloads", "prune", "--dry-run"],
        ["projections", "run", "--once"],
    ],
)
def test_commands_that_make_no_log_never_create_a_file_at_a_mistyped_path(
    command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    result = cli.invoke(app, [*command, "--db", "sqlite:///legder.db"])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: no log at ") and str(tmp_path / "legder.db") in result.output
    assert list(tmp_path.iterdir()) == []
    # The default URL too: no ./ledger.db appears for a read-only command.
    monkeypatch.delenv("LEDGER_DB", raising=False)
    monkeypatch.delenv("LEDGER_AUDITOR_DB", raising=False)
    assert cli.invoke(app, command).exit_code == 2
    assert list(tmp_path.iterdir()) == []


def test_a_read_only_store_refuses_writes(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    with pytest.raises(NoSuchLog):
        open_store(url, read_only=True)
    writer = open_store(url, migrate_schema=True)
    LogBuilder(writer).clean_sibling_group("p1", 2)
    head = writer.head()
    writer.close()
    reader = open_store(url, read_only=True)
    try:
        assert reader.head() == head
        with pytest.raises(EventStoreError):
            LogBuilder(reader).clean_sibling_group("p2", 2)
        assert reader.head() == head
    finally:
        reader.close()


def _read_only_copy(source: Path, folder: Path) -> list[str]:
    """`source` copied into `folder`, then both made unwritable for the command this returns a prefix
    for: by their modes when the tests do not run as root, else (root writes through modes) by a
    read-only bind mount of the folder in a mount namespace of the command's own."""
    folder.mkdir()
    shutil.copy(source, folder / "ledger.db")
    if os.geteuid() != 0:
        (folder / "ledger.db").chmod(0o444)
        folder.chmod(0o555)
        return []
    script = f'mount --bind "{folder}" "{folder}" && mount -o remount,bind,ro "{folder}" && exec "$@"'
    return ["unshare", "-m", "sh", "-c", script, "sh"]


def test_a_read_only_sqlite_file_is_audited(tmp_path: Path) -> None:
    source = tmp_path / "source.db"
    writer = open_store(f"sqlite:///{source}", migrate_schema=True)
    LogBuilder(writer).clean_sibling_group("p1", 3)
    head = writer.head()
    writer.close()
    folder = tmp_path / "ro"
    prefix = _read_only_copy(source, folder)
    url = f"sqlite:///{folder / 'ledger.db'}"
    try:
        probe = subprocess.run(
            [*prefix, sys.executable, "-c", f"open({str(folder / 'x')!r}, 'w')"], capture_output=True
        )
        assert probe.returncode != 0, "the folder must be unwritable for this test to mean anything"
        for command in (["audit"], ["status"], ["snapshot"]):
            done = subprocess.run(
                [*prefix, sys.executable, "-m", "cli.main", *command, "--db", url],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert done.returncode == 0, done.stderr
            assert "Traceback" not in done.stderr
        audit = subprocess.run(
            [*prefix, sys.executable, "-m", "cli.main", "audit", "--db", url],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert f"{head:,} events" in audit.stdout and "clean" in audit.stdout, audit.stdout
    finally:
        folder.chmod(0o755)
    assert sorted(p.name for p in folder.iterdir()) == ["ledger.db"]
