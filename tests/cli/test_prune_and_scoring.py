"""`ledger payloads prune` and the logprob queue: retention keeps the token records of tries the queue
has not scored yet, and a try whose records retention did remove is refused saying so.

The log holds two trained groups behind committed checkpoints (archived: done for good), their tries
sealed with real token records stored as the trainer stores them (`tests/workers/tries.py`), none
scored yet.  The commands run as a user runs them: the `ledger` script, in a subprocess, in the
environment a user has.  Once `ledger simulate --groups 48; ledger payloads prune --grace-s 0; ledger
worker logprobs --once` refused 88 of 192 tries for good ("token records ... are not stored").
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from eventstore import EventStore, open_store, upgrade_database
from eventstore.events import LogprobsComputed, LogprobsRefused
from eventstore.payload_stores import payload_plane
from projections.runner import rebuild
from protocol.streams import logprobs_stream
from tests.projections.builder import LogBuilder
from tests.userenv import ledger_command, user_env
from tests.workers.tries import SealedTry, seal_group
from workers.policy import DEFAULT_POLICY_SPEC, load_policy

GROUPS = ("early", "late")


@pytest.fixture
def url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    upgrade_database(url)
    return url


@pytest.fixture
def store(url: str) -> Iterator[EventStore]:
    s = open_store(url)
    try:
        yield s
    finally:
        s.close()


def trained_and_archived(store: EventStore) -> list[SealedTry]:
    """Two groups of two tries, each claimed for training, then checkpoints until both are archived;
    nothing scored."""
    policy = load_policy(DEFAULT_POLICY_SPEC)  # the one `ledger worker logprobs` scores with
    log = LogBuilder(store)
    tries: list[SealedTry] = []
    for step, group in enumerate(GROUPS, start=1):
        tries += seal_group(store, policy, group, 2)
        log.claim(group, step)
        log.checkpoint(f"c{step}")
    log.checkpoint("c3")
    assert set(rebuild(store).state("ledger").archived) == set(GROUPS)
    return tries


def ledger(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [ledger_command(), *args],
        capture_output=True, text=True, cwd=tmp_path, env=user_env(COLUMNS="200"), timeout=300,
    )  # fmt: skip


def said(done: subprocess.CompletedProcess[str]) -> str:
    return " ".join((done.stdout + done.stderr).split())


def results(store: EventStore) -> list[LogprobsComputed | LogprobsRefused]:
    found: list[LogprobsComputed | LogprobsRefused] = []
    for group in GROUPS:
        for event in store.read_stream(logprobs_stream(group)):
            decoded = event.decode()
            assert isinstance(decoded, (LogprobsComputed, LogprobsRefused))
            found.append(decoded)
    return found


def test_prune_keeps_the_token_records_the_queue_has_not_scored(
    tmp_path: Path, store: EventStore, url: str
) -> None:
    tries = trained_and_archived(store)
    target = payload_plane(store).default
    records = [t.receipt.tokens_digest for t in tries]

    kept = ledger(tmp_path, "payloads", "prune", "--db", url, "--grace-s", "0")
    assert kept.returncode == 0, said(kept)
    assert "nothing to prune" in said(kept) and "2 group(s) kept (a sealed try not scored yet" in said(kept)
    assert target.contains(records) == set(records)

    scored = ledger(tmp_path, "worker", "logprobs", "--db", url, "--once", "--json")
    assert scored.returncode == 0, said(scored)
    summary = json.loads(scored.stdout)
    assert (summary["scored"], summary["refused"], summary["queue_open"]) == (4, 0, 0), summary
    assert all(isinstance(r, LogprobsComputed) for r in results(store))

    # Scored: now the groups are done for good, and their payloads go.
    pruned = ledger(tmp_path, "payloads", "prune", "--db", url, "--grace-s", "0")
    assert pruned.returncode == 0 and "pruned 2 done group(s)" in said(pruned), said(pruned)
    assert not target.contains(records)


def test_a_try_whose_records_retention_removed_is_refused_saying_so(
    tmp_path: Path, store: EventStore, url: str
) -> None:
    """`--unscored` (a log no worker scores) prunes them anyway; a worker that comes later refuses each
    try for good, and the refusal in the log names retention, not a lost payload."""
    tries = trained_and_archived(store)
    pruned = ledger(tmp_path, "payloads", "prune", "--db", url, "--grace-s", "0", "--unscored")
    assert pruned.returncode == 0 and "pruned 2 done group(s)" in said(pruned), said(pruned)
    position = int(said(pruned).split("recorded at position ")[1].split(";")[0])

    refused = ledger(tmp_path, "worker", "logprobs", "--db", url, "--once", "--json")
    assert refused.returncode == 0, said(refused)
    summary = json.loads(refused.stdout)
    assert (summary["scored"], summary["refused"], summary["queue_open"]) == (0, 4, 0), summary
    found = results(store)
    assert len(found) == 4 and all(isinstance(r, LogprobsRefused) for r in found)
    by_try = {(r.rollout_id, r.attempt_index): r for r in found if isinstance(r, LogprobsRefused)}
    for t in tries:
        reason = by_try[(t.rollout_id, t.attempt_index)].reason
        assert reason == (
            f"token records {t.receipt.tokens_digest} were removed by retention (`ledger payloads prune`, "
            f"PayloadsPruned at position {position}) before this try was scored"
        ), reason
