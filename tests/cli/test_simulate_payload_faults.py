"""`ledger simulate` against a payload store that refuses: one line and exit status 2, nothing sealed
without its payload, and `--resume` finishes the run once the store is fixed.  Real subprocesses of
the real CLI, on a SQLite log and a local payload directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from eventstore import open_store

# Far above what these runs take; reached only if a run waits for ever (the fault under test).
RUN_BOUND_S = 240.0
RUN = ["--groups", "3", "--siblings", "2", "--checkpoint-every", "0", "--faults", ""]


def _ledger(tmp_path: Path, store: Path, *args: str) -> subprocess.CompletedProcess[str]:
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
