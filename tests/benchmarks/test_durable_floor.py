"""The durable-floor benchmark, small: the floor writes the run's own rows with the log's own hash
chain and its payloads whole, the log's layers store the same, and bad arguments are one line."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import pytest

from benchmarks import durable_floor

COLUMNS = "stream_id, stream_version, event_id, type, schema_version, data"


@pytest.fixture(scope="module")
def run_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run's log (`ledger simulate`, three groups), its payload directory beside it."""
    return durable_floor.run_once(tmp_path_factory.mktemp("run"), groups=3)


@pytest.fixture(scope="module")
def source(run_log: Path) -> durable_floor.Source:
    return durable_floor.read_source(run_log)


def _rows(log: Path, columns: str) -> list[tuple[object, ...]]:
    with sqlite3.connect(log) as db:
        return db.execute(f"SELECT {columns} FROM events ORDER BY position").fetchall()


def _payloads(root: Path) -> dict[str, bytes]:
    """Every whole payload file under `root` (the store's layout or the floor's), by digest."""
    return {f"sha256:{p.name}": p.read_bytes() for p in root.glob("**/*") if len(p.name) == 64}


def test_the_source_is_the_runs_own_rows_and_payloads(source: durable_floor.Source) -> None:
    assert source.rollouts == 3 * 4  # the simulation's default: four siblings a group
    assert sum(1 for row in source.rows if row[3] == durable_floor.SEALED) == source.rollouts
    assert source.payloads and all(
        hashlib.sha256(content).hexdigest() == digest.partition(":")[2] for digest, content in source.payloads
    )


@pytest.mark.parametrize("per_commit", [1, 5])
def test_the_commits_hold_every_row_and_payload_once_in_order(
    source: durable_floor.Source, per_commit: int
) -> None:
    commits = list(source.commits(per_commit))
    assert [r for rows, _ in commits for r in rows] == source.rows
    assert [p for _, payloads in commits for p in payloads] == source.payloads
    assert len(commits) == pytest.approx(source.rollouts / per_commit, abs=1)


def test_the_floor_writes_the_runs_rows_with_the_logs_own_chain(
    run_log: Path, source: durable_floor.Source, tmp_path: Path
) -> None:
    assert durable_floor.floor(source, 4, tmp_path) > 0
    chained = f"{COLUMNS}, metadata, prev_hash, hash"
    # Row for row what the run's log holds, each hash chained as the log chained it.
    assert _rows(tmp_path / "log.db", chained) == _rows(run_log, chained)
    assert _payloads(tmp_path / "payloads") == dict(source.payloads)


def test_the_logs_layers_store_the_same_rows_and_payloads(
    source: durable_floor.Source, tmp_path: Path
) -> None:
    assert durable_floor.layers(source, 4, tmp_path) > 0
    assert _rows(tmp_path / "log.db", COLUMNS) == [row[:6] for row in source.rows]
    assert _payloads(tmp_path / "payloads") == dict(source.payloads)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--per-commit", "0"], "argument --per-commit: 0 is not at least 1"),
        (["--rounds", "x"], "argument --rounds: 'x' is not a whole number"),
        (["--log", "/nonexistent/ledger.db"], "--log: no SQLite log at /nonexistent/ledger.db"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(
    args: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        durable_floor.main(args)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and says in err and "Traceback" not in err, err
