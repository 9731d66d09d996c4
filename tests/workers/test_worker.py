"""The worker on a real log (SQLite and PostgreSQL): one result per try, atomic, idempotent, refusals."""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from dataclasses import replace

import pytest
import torch
from pydantic import ValidationError
from sqlalchemy import text
from typer.testing import CliRunner

from cli.main import app
from eventstore import EventIdConflict, EventStore, NewEvent, open_store
from eventstore.events import LogprobsComputed, LogprobsRefused
from eventstore.payload_stores import payload_plane
from protocol.streams import logprobs_stream
from tests.workers.tries import SealedTry, Tamper, seal_group, with_receipt, with_tokens_digest
from workers.logprobs import (
    LOGPROBS_MEDIA_TYPE,
    LogprobWorker,
    WorkerConfig,
    decode_logprobs,
    result_event_id,
    work_kind,
)
from workers.policy import Policy, load_policy

FAST = WorkerConfig(claim_size=4, poll_interval_s=0.05, backend="torch")


def results(store: EventStore) -> list[LogprobsComputed | LogprobsRefused]:
    out = []
    for recorded in store.read_all(0, types={"LogprobsComputed", "LogprobsRefused"}):
        event = recorded.decode()
        assert isinstance(event, LogprobsComputed | LogprobsRefused)
        assert recorded.stream_id == logprobs_stream(event.rollout_id.rpartition("_g")[0])
        assert recorded.event_id == str(
            result_event_id(event.rollout_id, event.attempt_index, event.policy_version)
        )
        out.append(event)
    return out


def assert_each_once(store: EventStore, tries: list[SealedTry], version: str) -> list[LogprobsComputed]:
    mine = [e for e in results(store) if e.policy_version == version]
    counts = Counter((e.rollout_id, e.attempt_index) for e in mine)
    assert counts == Counter({(t.rollout_id, t.attempt_index): 1 for t in tries})
    computed = [e for e in mine if isinstance(e, LogprobsComputed)]
    for event in computed:
        assert event.logprobs is not None and event.logprobs.media_type == LOGPROBS_MEDIA_TYPE
        array = decode_logprobs(payload_plane(store).get(event.logprobs_claim()))
        assert array.shape[0] == event.token_count
        assert float(array.double().sum()) == pytest.approx(event.logprob_sum, abs=1e-9)
    return computed


def test_scores_every_sealed_try_once_per_policy_version(
    store: EventStore, policy: Policy, other_policy: Policy
) -> None:
    tries = seal_group(store, policy, "wa", 3) + seal_group(store, policy, "wb", 2)
    # backend="auto": Triton (interpreted here), the worker's default path.
    stats = LogprobWorker(store, policy, replace(FAST, backend="auto", batch_tokens=32)).run(once=True)
    assert (stats.scored, stats.refused, stats.duplicates) == (5, 0, 0)
    computed = assert_each_once(store, tries, policy.policy_version)
    by_try = {(e.rollout_id, e.attempt_index): e for e in computed}
    for t in tries:
        event = by_try[(t.rollout_id, t.attempt_index)]
        assert event.token_count == t.receipt.token_count
        assert event.max_abs_diff < 1e-4
        assert stats.max_abs_diff == pytest.approx(max(e.max_abs_diff for e in computed))

    # Nothing new sealed: a second pass finds nothing; a new seal is picked up.
    assert LogprobWorker(store, policy, FAST).run(once=True).scored == 0
    more = seal_group(store, policy, "wc", 1)
    assert LogprobWorker(store, policy, FAST).run(once=True).scored == 1

    # A changed policy is a new version: every try again, with a clearly larger drift.
    changed = LogprobWorker(store, other_policy, FAST).run(once=True)
    assert changed.scored == 6 and changed.max_abs_diff > 0.5
    other = assert_each_once(store, tries + more, other_policy.policy_version)
    assert min(e.max_abs_diff for e in other) > 1000 * max(e.max_abs_diff for e in computed)
    assert store.verify_chain() is None


def test_lost_lease_table_does_not_score_twice(store: EventStore, policy: Policy) -> None:
    tries = seal_group(store, policy, "wl", 3)
    LogprobWorker(store, policy, FAST).run(once=True)
    before = store.head()
    # The lease table is work state, not truth: wipe it and the log still refuses a second result.
    with store.transaction() as tx:
        tx.connection.execute(text("DELETE FROM work_leases"))
        tx.connection.execute(text("DELETE FROM subscriptions"))
    stats = LogprobWorker(store, policy, FAST).run(once=True)
    assert (stats.scored, stats.duplicates) == (0, 0)
    assert store.head() == before
    assert_each_once(store, tries, policy.policy_version)

    # A result for the same try with other numbers is refused by its event id.
    first = next(e for e in results(store) if isinstance(e, LogprobsComputed))
    forged = first.model_copy(update={"logprob_sum": first.logprob_sum - 1})
    with pytest.raises(EventIdConflict):
        store.append(
            logprobs_stream("wl"),
            [NewEvent.of(forged, event_id=result_event_id(first.rollout_id, 0, first.policy_version))],
        )


def test_a_result_that_races_another_workers_is_not_recorded_twice(store: EventStore, policy: Policy) -> None:
    """Two workers scored the same try (the first one's lease had expired): one result, one duplicate."""
    seal_group(store, policy, "wr", 1)
    slow = LogprobWorker(store, policy, replace(FAST, lease_s=0.2))
    fast = LogprobWorker(store, policy, FAST)
    slow.board.enqueue()
    claims = slow.board.claim(4)
    assert len(claims) == 1
    time.sleep(0.3)
    assert fast.run(once=True).scored == 1
    slow._process(claims, set())
    assert (slow.stats.scored, slow.stats.duplicates) == (0, 1)
    assert len(results(store)) == 1


def _tampered_blob(store: EventStore) -> Tamper:
    def change(t: SealedTry) -> SealedTry:
        # Another content under the receipt's digest (as if the payload store were edited).
        return replace(t, stored=t.blob.replace(b'"call-1"', b'"call-9"'))

    return change


def test_bad_token_records_are_refused_and_recorded(store: EventStore, policy: Policy) -> None:
    missing = "sha256:" + hashlib.sha256(b"nothing").hexdigest()
    tries = seal_group(
        store,
        policy,
        "wt",
        6,
        tamper={
            1: lambda t: with_receipt(t, capture_key="wt_g9"),
            2: lambda t: with_receipt(t, model_call_ids=["call-1", "call-2", "call-3", "call-4"]),
            3: lambda t: with_receipt(t, token_count=t.receipt.token_count + 1),
            4: _tampered_blob(store),
            5: lambda t: with_tokens_digest(t, missing),
        },
    )
    stats = LogprobWorker(store, policy, FAST).run(once=True)
    assert (stats.scored, stats.refused) == (1, 5)
    events = {e.rollout_id: e for e in results(store)}
    assert len(events) == 6
    assert isinstance(events["wt_g0"], LogprobsComputed)
    expected = {
        "wt_g1": "capture key",
        "wt_g2": "model calls",
        "wt_g3": "generated tokens",
        "wt_g4": "hash to",
        "wt_g5": "are not stored",
    }
    for rollout_id, needle in expected.items():
        event = events[rollout_id]
        assert isinstance(event, LogprobsRefused), rollout_id
        assert needle in event.reason
    # No array was stored for a refused try.
    assert _array_blobs(store) == 1
    assert all(t.rollout_id in events for t in tries)


def _array_blobs(store: EventStore) -> int:
    """Payloads stored that no seal claims: the logprob arrays."""
    tokens = {e.data["receipt"]["tokens_digest"] for e in store.read_all(types=["SiblingSealed"])}
    return sum(p.digest not in tokens for p in payload_plane(store).default.scan())


def test_a_diverged_policy_refuses_each_try_and_leaves_the_log_readable(
    store: EventStore, policy: Policy
) -> None:
    """A policy whose weights went NaN (a blown-up training step) scores every token NaN.  Before, the
    worker wrote `LogprobsComputed` with its sums as `null`: an event no reader of the log could
    decode again.  Now each try is refused with the reason, and no array is stored."""
    tries = seal_group(store, policy, "wn", 3)
    diverged = load_policy("tiny")
    with torch.no_grad():
        diverged.model.lm_head_weight[3] = float("nan")
    diverged = Policy(diverged.model, "tiny:diverged")
    stats = LogprobWorker(store, diverged, FAST).run(once=True)
    assert (stats.scored, stats.refused) == (0, 3)
    events = results(store)  # every event of the log decodes
    assert {(e.rollout_id, e.attempt_index) for e in events} == {
        (t.rollout_id, t.attempt_index) for t in tries
    }
    for event in events:
        assert isinstance(event, LogprobsRefused) and "NaN or infinite" in event.reason
    assert _array_blobs(store) == 0
    # The healthy policy still scores them (its own version's leases).
    assert LogprobWorker(store, policy, FAST).run(once=True).scored == 3


def test_an_event_holding_a_number_json_cannot_carry_is_refused_when_made() -> None:
    fields = {"rollout_id": "e_g0", "attempt_index": 0, "policy_version": "v", "token_count": 1}
    fields |= {"max_abs_diff": 0.0, "mean_abs_diff": 0.0, "blob_digest": "sha256:" + "0" * 64}
    for value in (float("nan"), float("inf"), float("-inf")):
        with pytest.raises(ValidationError, match="finite number"):
            LogprobsComputed(logprob_sum=value, **fields)
    assert LogprobsComputed(logprob_sum=-1.5, **fields).logprob_sum == -1.5


def test_leases_are_per_policy_version(store: EventStore, policy: Policy, other_policy: Policy) -> None:
    seal_group(store, policy, "wv", 2)
    LogprobWorker(store, policy, FAST).run(once=True)
    with store.transaction() as tx:
        rows = tx.connection.execute(
            text("SELECT kind, COUNT(*) FROM work_leases WHERE done GROUP BY kind")
        ).all()
    kinds = {str(r[0]): int(r[1]) for r in rows}
    assert kinds == {work_kind(policy.policy_version): 2}
    assert LogprobWorker(store, other_policy, FAST).counts().total == 0


def test_cli_drains_and_prints_a_summary(sqlite_url: str, policy: Policy) -> None:
    store = open_store(sqlite_url, migrate_schema=True)
    try:
        seal_group(store, policy, "wcli", 3)
    finally:
        store.close()
    args = [
        "worker",
        "logprobs",
        "--db",
        sqlite_url,
        "--once",
        "--backend",
        "torch",
        "--poll-interval",
        "0.05",
    ]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout[result.stdout.index("{") :])
    assert summary["scored"] == 3 and summary["queue_open"] == 0
    assert summary["max_abs_diff"] < 1e-4
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0, again.output
    assert "scored" in again.stdout
    bad = CliRunner().invoke(app, ["worker", "logprobs", "--db", sqlite_url, "--policy", "huge"])
    assert bad.exit_code == 2 and "unknown policy" in bad.output


def test_a_log_written_before_claims_is_scored_from_its_blob_table(store: EventStore, policy: Policy) -> None:
    tries = seal_group(store, policy, "wl", 2, legacy=True)
    assert all(t.receipt.tokens is None for t in tries)
    stats = LogprobWorker(store, policy, FAST).run(once=True)
    assert (stats.scored, stats.refused) == (2, 0)
    assert_each_once(store, tries, policy.policy_version)
