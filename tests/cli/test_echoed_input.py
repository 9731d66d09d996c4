"""What a command echoes back of the user's input is bounded and escaped, and answers at once.

Once `ledger show` with a 100,000-character id ran for minutes (rich's highlighter over the "no events
about ID" line: still running after 60 s), and a `--db` path longer than a file name can be was a
traceback.  The commands run as a user runs them: the `ledger` script, in the environment a user has,
on a real log.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from eventstore import open_store, upgrade_database
from tests.projections.builder import LogBuilder
from tests.userenv import ledger_command, user_env

LONG = "x" * 100_000  # under the kernel's limit on one argument (128 KiB)
# Far above what any of these commands takes; reached only if one hangs (the fault under test).
ANSWER_BOUND_S = 120


@pytest.fixture
def url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    upgrade_database(url)
    store = open_store(url)
    try:
        LogBuilder(store).clean_sibling_group("p1", step=1)
    finally:
        store.close()
    return url


def ledger(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [ledger_command(), *args],
        capture_output=True, text=True, cwd=tmp_path, env=user_env(COLUMNS="80"), timeout=ANSWER_BOUND_S,
    )  # fmt: skip


def one_line(done: subprocess.CompletedProcess[str], status: int) -> str:
    assert done.returncode == status, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Traceback" not in done.stdout + done.stderr
    [line] = done.stderr.splitlines()
    assert len(line) < 1200, len(line)  # bounded, whatever was typed
    return line


@pytest.mark.parametrize(
    "args",
    [
        ["show", LONG],
        ["debt", "drop", LONG, "0", "--reason", "gone"],
        ["show", "p1_g0 [red]x[/red]"],
    ],
    ids=["show", "debt drop", "show markup"],
)
def test_an_id_that_is_no_rollout_id_is_one_bounded_line(tmp_path: Path, url: str, args: list[str]) -> None:
    line = one_line(ledger(tmp_path, *args, "--db", url), 2)
    assert line.startswith("error: '") and "is not a rollout id (at most 200 characters" in line, line
    if LONG in args:
        assert "… (100,000 characters)" in line, line
    else:
        assert "[red]x[/red]" in line, line  # escaped: shown as typed, not taken for markup


def test_an_unknown_id_and_an_unknown_agent_are_echoed_as_typed(tmp_path: Path, url: str) -> None:
    unknown = "q" * 200  # the longest id there can be
    line = one_line(ledger(tmp_path, "show", unknown, "--db", url), 1)
    assert line == f"no events about {unknown}", line
    line = one_line(
        ledger(tmp_path, "debt", "drop", "p1_g0", "0", "--reason", "r", "--agent", LONG, "--db", url), 2
    )
    assert line.startswith("error: no unpaid ACK debt and no retire owed for p1_g0#0 to agent 'xxx"), line
    assert line.endswith("characters)"), line


@pytest.mark.parametrize(
    "args",
    [
        ["status", "--db", f"sqlite:///{'y' * 300}"],
        ["show", "p1_g0", "--db", f"sqlite:///{'y' * 300}"],
        ["audit", "--payloads", "y" * 300],
        ["simulate", "--resume", LONG],
        ["simulate", "--db", LONG],
    ],
    ids=["status --db", "show --db", "audit --payloads", "simulate --resume", "simulate --db"],
)
def test_a_path_or_name_too_long_is_one_bounded_line(tmp_path: Path, url: str, args: list[str]) -> None:
    if args[0] == "audit":
        args = [*args, "--db", url]
    done = ledger(tmp_path, *args)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Traceback" not in done.stdout + done.stderr
    assert len(done.stdout + done.stderr) < 3000, len(done.stdout + done.stderr)
