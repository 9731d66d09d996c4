"""`ledger replay | snapshot | audit | show | status | tail | projections run` on a small log."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from eventstore import EventStore
from projections.recovery import RECOVERY_SCHEMA_VERSION, RolloutRecoveryState
from projections.runner import RUNNER_NAME, ProjectionRunner
from tests.projections.builder import LogBuilder
from tests.projections.simulator import Simulator
from tests.projections.tamper import append_raw

cli = CliRunner()
ROOT = Path(__file__).parents[2]


@pytest.fixture
def history(store: EventStore, log: LogBuilder) -> EventStore:
    Simulator(log, random.Random(5)).run(40)
    log.clean_sibling_group("shown", 2)
    log.fail("shown_g0")  # a later failure: the show has a group event and a try event at least
    return store


def run(*args: str) -> tuple[int, str]:
    result = cli.invoke(app, list(args))
    return result.exit_code, result.output


def test_replay_and_verify(history: EventStore, db_url: str) -> None:
    code, out = run("replay", "--db", db_url, "--from-scratch")
    assert code == 0 and f"rebuilt to position {history.head()} from scratch" in out and "ledger" in out
    code, out = run("replay", "--db", db_url, "--to", "10", "--save")
    assert (
        code == 0
        and "rebuilt to position 10" in out
        and "stored a projection checkpoint at position 10" in out
    )
    runner = ProjectionRunner(history, checkpoint_every=25)
    runner.catch_up()
    runner.checkpoint()
    code, out = run("replay", "--db", db_url, "--verify")
    assert code == 0 and "rebuilds agree" in out and "live" in out, out
    code, out = run("replay", "--db", db_url)
    assert code == 0 and "from checkpoint" in out


def test_verify_checks_to_the_head_past_the_newest_checkpoint(
    history: EventStore, log: LogBuilder, db_url: str
) -> None:
    runner = ProjectionRunner(history, checkpoint_every=10_000)
    runner.catch_up()
    runner.checkpoint()
    stored_at = history.head()
    log.clean_sibling_group("after-checkpoint", 3)
    head = history.head()
    assert head > stored_at
    code, out = run("replay", "--db", db_url, "--verify")
    assert code == 0 and f"rebuilds agree at position {head}" in out, out
    assert f"from checkpoint at {stored_at}" in out, out
    # Told `--to`, it stops there (the runner's checkpoint at that position is compared as well).
    code, out = run("replay", "--db", db_url, "--verify", "--to", str(stored_at))
    assert code == 0 and f"rebuilds agree at position {stored_at}" in out and "live" in out, out


def test_replay_refuses_a_corrupted_event(history: EventStore, db_url: str) -> None:
    bad = append_raw(history, db_url, "group-shown", "AckAccepted", 1, '{"rollout_id": 5}')
    code, out = run("replay", "--db", db_url)
    assert code == 1 and "replay refused" in out and f"position {bad}" in out


def test_snapshot_is_the_recovery_state(history: EventStore, db_url: str) -> None:
    code, out = run("snapshot", "--db", db_url, "--at", "30")
    assert code == 0
    data = json.loads(out)
    assert data["schema_version"] == RECOVERY_SCHEMA_VERSION and data["position"] == 30
    RolloutRecoveryState.model_validate(data)


def test_audit_clean_and_broken(history: EventStore, log: LogBuilder, db_url: str) -> None:
    code, out = run("audit", "--db", db_url)
    assert code == 0 and "clean" in out
    first = log.claim("shown", 1)[0]
    second = log.claim("shown", 2)[0]
    code, out = run("audit", "--db", db_url)
    assert code == 1 and "trained-once" in out and f"{first}, {second}" in out
    code, out = run("audit", "--db", db_url, "--json")
    report = json.loads(out)
    assert code == 1 and report["events"] == history.head() and "hash-chain" in report["rules_checked"]
    assert report["violations"] == [
        {"rule": "trained-once", "positions": [first, second], "message": report["violations"][0]["message"]}
    ]


def test_show_tree_and_swimlane(history: EventStore, db_url: str, tmp_path: Path) -> None:
    page = tmp_path / "shown.html"
    code, out = run("show", "shown_g0", "--db", db_url, "--html", str(page))
    assert code == 0 and "try #0" in out and "RunFailed" in out and "GroupReserved" in out
    html = page.read_text()
    assert "<svg" in html and "Gym agent" in html and "<title>position" in html
    assert "src=" not in html and "<link" not in html and "@import" not in html  # self-contained
    code, out = run("show", "nobody_g0", "--db", db_url)
    assert code == 1


def test_status(history: EventStore, db_url: str) -> None:
    code, out = run("status", "--db", db_url)
    assert code == 0 and "groups" in out and "debts" in out and f"log head: {history.head()}" in out


def test_tail_follows_and_stops_when_idle(history: EventStore, db_url: str) -> None:
    code, out = run("tail", "--db", db_url, "--from", str(history.head() - 3), "--idle-exit", "0.2")
    lines = [line for line in out.splitlines() if line.strip()]
    assert code == 0 and len(lines) == 3 and "RunFailed" in lines[-1]


def test_tail_from_the_head_that_sees_nothing_says_where_it_started(history: EventStore, db_url: str) -> None:
    result = cli.invoke(app, ["tail", "--db", db_url, "--idle-exit", "0.2"])
    assert result.exit_code == 0 and result.stdout.strip() == "", result.output
    hint = result.stderr
    assert f"after position {history.head()}" in hint and "--from 0" in hint, hint


def test_projections_run_stores_a_checkpoint_that_replay_and_status_use(
    history: EventStore, log: LogBuilder, db_url: str
) -> None:
    head = history.head()
    code, out = run("projections", "run", "--db", db_url, "--once", "--checkpoint-every", "25")
    assert code == 0 and f"to {head}; last checkpoint at {head}" in out, out
    code, out = run("status", "--db", db_url)
    assert code == 0 and f"projection runner at {head}" in out, out
    code, out = run("replay", "--db", db_url, "--verify")
    assert code == 0 and "rebuilds agree" in out and f"live (stored at {head})" in out, out
    # Following the log: it resumes from its checkpoint, folds what came since, and stops when idle.
    log.clean_sibling_group("later", 2)
    code, out = run("projections", "run", "--db", db_url, "--idle-exit", "0.2", "--poll-interval", "0.02")
    assert code == 0 and f"from position {head} to {history.head()}" in out, out
    code, out = run("status", "--db", db_url)
    assert f"projection runner at {history.head()}" in out, out


def test_projections_run_follows_the_log_and_stops_on_sigterm_with_a_checkpoint(
    store: EventStore, log: LogBuilder, db_url: str
) -> None:
    """The runner as its own process: it follows appends made after it started, and SIGTERM ends it
    cleanly with a checkpoint at the position it reached.  Each step waits for its gate (the runner's
    stored position, one checkpoint per event here), never for a time."""
    log.clean_sibling_group("before", 2)
    cmd = [sys.executable, "-m", "cli.main", "projections", "run", "--db", db_url, "--checkpoint-every", "1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:

        def reaches(position: int) -> None:
            deadline = time.monotonic() + 60
            while store.subscriber_position(RUNNER_NAME) < position:
                assert proc.poll() is None, proc.communicate()[0]
                assert time.monotonic() < deadline, f"the runner did not reach position {position}"
                time.sleep(0.05)

        reaches(store.head())
        log.clean_sibling_group("after", 2)  # appended while it follows
        reaches(store.head())
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, out
    assert f"last checkpoint at {store.head()}" in out, out


def test_show_draws_the_turns_carried_across_tries(
    store: EventStore, log: LogBuilder, db_url: str, tmp_path: Path
) -> None:
    """Try 0 is retired after turn 2, try 1 resumes there and is retired after turn 4, try 2 resumes
    that: the tree and the swimlane say which try carried which turns from which."""
    from tests.projections.test_turn_audit import RID
    from tests.projections.test_turn_audit import history as turn_history

    turn_history(log, told=4)
    page = tmp_path / "turns.html"
    code, out = run("show", RID, "--db", db_url, "--html", str(page))
    text = " ".join(w for w in out.split() if w.strip("│├└─"))  # the tree's lines wrap inside its glyphs
    assert code == 0, out
    assert "try #1 carries turns 1..2 of try #0 (2 model calls, 80 generated tokens reused" in text
    assert "try #2 carries turns 1..4 of try #1 (4 model calls, 160 generated tokens reused" in text
    assert "offered its boundary after turn 4 when retired" in text
    html = page.read_text()
    assert html.count('<path class="carry"') == 2  # each from the retire that offered it to the resume
    assert "turns 1..2 from #0" in html and "turns 1..4 from #1" in html and "Turns across tries" in html
