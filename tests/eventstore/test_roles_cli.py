"""`ledger db` commands and the writer/auditor roles on a real PostgreSQL."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ProgrammingError
from typer.testing import CliRunner, Result

from cli.main import app
from eventstore import open_store
from eventstore.events import AttemptMinted

runner = CliRunner()


def test_db_upgrade_then_open(sqlite_url: str) -> None:
    result = runner.invoke(app, ["db", "upgrade", "--db", sqlite_url])
    assert result.exit_code == 0, result.output
    assert "0008" in result.output
    open_store(sqlite_url).close()
    result = runner.invoke(app, ["db", "current", "--db", sqlite_url])
    assert "database: 0008" in result.output


def test_db_upgrade_unreachable_is_a_clear_error() -> None:
    result = runner.invoke(app, ["db", "upgrade", "--db", "postgresql+psycopg://u:topsecret@127.0.0.1:1/x"])
    assert result.exit_code == 2
    assert "unavailable" in result.output and "topsecret" not in result.output


def test_writer_cannot_update_or_delete_and_auditor_cannot_insert(pg_url: str) -> None:
    assert runner.invoke(app, ["db", "upgrade", "--db", pg_url]).exit_code == 0
    result = runner.invoke(
        app,
        ["db", "roles", "--db", pg_url, "--writer-password", "wpw", "--auditor-password", "apw"],
    )
    assert result.exit_code == 0, result.output
    base = make_url(pg_url)
    writer_url = base.set(username="ledger_writer", password="wpw").render_as_string(hide_password=False)
    auditor_url = base.set(username="ledger_auditor", password="apw").render_as_string(hide_password=False)

    writer = open_store(writer_url)
    writer.append("group-p1", [AttemptMinted(rollout_id="p1_g0", generation_index=0)])
    writer.save_position("tailer", 1)
    assert writer.head() == 1
    engine = create_engine(writer_url)
    for statement in ("UPDATE events SET type = 'X'", "DELETE FROM events", "TRUNCATE events"):
        with pytest.raises(ProgrammingError, match="permission denied"), engine.begin() as conn:
            conn.execute(text(statement))

    auditor = open_store(auditor_url)
    assert [e.type for e in auditor.read_all()] == ["AttemptMinted"]
    assert auditor.verify_chain() is None
    with pytest.raises(Exception, match="permission denied"):
        auditor.append("group-p1", [AttemptMinted(rollout_id="p1_g1", generation_index=1)])
    assert writer.head() == 1


def test_read_only_commands_run_as_the_auditor_role(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert runner.invoke(app, ["db", "upgrade", "--db", pg_url]).exit_code == 0
    args = ["db", "roles", "--db", pg_url, "--writer-password", "wpw", "--auditor-password", "apw"]
    assert runner.invoke(app, args).exit_code == 0
    base = make_url(pg_url)
    writer_url = base.set(username="ledger_writer", password="wpw").render_as_string(hide_password=False)
    auditor_url = base.set(username="ledger_auditor", password="apw").render_as_string(hide_password=False)
    open_store(writer_url).append("group-p1", [AttemptMinted(rollout_id="p1_g0", generation_index=0)])

    # The writer's URL is LEDGER_DB; read-only commands take LEDGER_AUDITOR_DB when it is set.
    monkeypatch.setenv("LEDGER_DB", "postgresql+psycopg://nobody:x@127.0.0.1:1/none")
    monkeypatch.setenv("LEDGER_AUDITOR_DB", auditor_url)
    for command in (["audit", "--json"], ["status"], ["snapshot"]):
        result = runner.invoke(app, command)
        assert result.exit_code == 0, (command, result.output)
    assert '"events": 1' in runner.invoke(app, ["audit", "--json"]).output
    # ...and a writer command does not: it goes to LEDGER_DB, which is unreachable here.
    assert runner.invoke(app, ["replay"]).exit_code != 0
    monkeypatch.setenv("LEDGER_DB", writer_url)
    assert runner.invoke(app, ["replay"]).exit_code == 0


def _error_line(result: Result) -> str:
    """The command's one line (exit status 2, no traceback)."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    [line] = result.output.strip().splitlines()
    return line


def test_db_roles_refusals_are_one_line(pg_url: str, sqlite_url: str) -> None:
    roles = ["db", "roles", "--writer-password", "wpw", "--auditor-password", "apw"]
    line = _error_line(runner.invoke(app, [*roles, "--db", "postgresql+psycopg://u:topsecret@127.0.0.1:1/x"]))
    assert "unavailable" in line and "topsecret" not in line
    assert "only on PostgreSQL" in _error_line(runner.invoke(app, [*roles, "--db", sqlite_url]))
    line = _error_line(runner.invoke(app, [*roles, "--db", pg_url]))  # reachable, never upgraded
    assert "no ledger schema" in line and "ledger db upgrade" in line

    assert runner.invoke(app, ["db", "upgrade", "--db", pg_url]).exit_code == 0
    assert runner.invoke(app, [*roles, "--db", pg_url]).exit_code == 0
    base = make_url(pg_url)
    auditor_url = base.set(username="ledger_auditor", password="apw").render_as_string(hide_password=False)
    # A role without the right to make roles: refused in one line, password hidden, nothing changed.
    args = [
        "db",
        "roles",
        "--db",
        auditor_url,
        "--writer-password",
        "changed",
        "--auditor-password",
        "changed",
    ]
    line = _error_line(runner.invoke(app, args))
    assert "made no roles" in line and "permission denied" in line and "apw" not in line, line
    writer_url = base.set(username="ledger_writer", password="wpw").render_as_string(hide_password=False)
    open_store(writer_url).close()  # the writer's password is still the one set before
