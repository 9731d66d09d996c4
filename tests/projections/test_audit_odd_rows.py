"""Rows the trainer does not write but the audit reads all the same, each with what it reports: a try's
rows on a stream of no group (its group then read from the rollout id); a try whose agent is named
apart by its dispatch, its receipt and its debt, and agents' processes told apart by incarnation (one
shared by two agents, an old one reappearing after a restart); replacements out of order followed by
more; a version-2 commit naming another trainer than its prepare, as an older trainer wrote it."""

from __future__ import annotations

from eventstore import EventStore, NewEvent
from eventstore.events import (
    AckOwed,
    ReceiptFetched,
    ReplacementMinted,
    RunDispatched,
    RunFailed,
)
from projections.audit import (
    ARCHIVED_BY_OWN_CUT,
    BOUNDED_RETRIES,
    NO_REUSED_TRY,
    NO_STRANDED_RESULT,
    RECEIPT_MATCHES,
    RETIRE_BEFORE_REPLACE,
)
from protocol.ids import capture_key
from protocol.streams import checkpoint_stream, trainer_stream
from tests.projections.audit_fold import audit_both_ways
from tests.projections.builder import LogBuilder, completion_receipt

STRAY = trainer_stream("T9")  # a stream of no group


def said(store: EventStore) -> list[tuple[str, list[int], str]]:
    return [(v.rule, v.positions, v.message) for v in audit_both_ways(store).violations]


def replacement(rollout_id: str, index: int, replaces: int) -> ReplacementMinted:
    return ReplacementMinted(
        rollout_id=rollout_id,
        generation_index=int(rollout_id.rpartition("_g")[2]),
        attempt_index=index,
        replaces=replaces,
        reason="retry",
    )


def dispatch_to(log: LogBuilder, rollout_id: str, agent: str) -> int:
    (at,) = log.group(
        "p",
        [
            RunDispatched(
                rollout_id=rollout_id,
                attempt_index=0,
                capture_key=capture_key(rollout_id, 0),
                agent_name=agent,
            )
        ],
    )
    return at


def fetch(log: LogBuilder, rollout_id: str, agent: str, generation: int, stream: str | None = None) -> int:
    event = ReceiptFetched(agent_name=agent, receipt=completion_receipt(rollout_id, 0, generation=generation))
    (at,) = log.append(stream, [event]) if stream is not None else log.group("p", [event])
    return at


def test_a_replacement_on_a_stream_of_no_group_is_minted_after_the_dead_letter(
    store: EventStore, log: LogBuilder
) -> None:
    log.reserve("p", 2)
    log.mint("p", 2)
    (dead,) = log.dead_letter("p", {0: 0})
    (late,) = log.append(STRAY, [replacement("p_g0", 1, 0)])
    assert said(store) == [
        (BOUNDED_RETRIES, [dead, late], "try p_g0#1 is minted after group p was dead-lettered"),
    ]


def test_a_refusal_on_a_stream_of_no_group_still_marks_its_group_refused(
    store: EventStore, log: LogBuilder
) -> None:
    log.reserve("p", 2)
    log.mint("p", 2)
    (refused,) = log.append(
        STRAY, [RunFailed(rollout_id="p_g0", attempt_index=0, reason="cannot serve", kind="refused")]
    )
    (again,) = log.replace("p_g0", 1)
    assert said(store) == [
        (
            BOUNDED_RETRIES,
            [refused, again],
            f"try p_g0#1 is minted after the agent refused a try of group p as a request it can never serve "
            f"(at {refused}): the same request is retried",
        ),
    ]


def test_a_receipt_fetched_on_a_stream_of_no_group_shows_its_agent_restarted(
    store: EventStore, log: LogBuilder
) -> None:
    """The agent's new process is seen through a receipt written apart: the old try needs no retire."""
    log.reserve("p", 2, trainer="T1")
    log.mint("p", 2)
    dispatch_to(log, "p_g0", "a")
    finished = fetch(log, "p_g0", "a", 1)
    fetch(log, "p_g1", "a", 2, stream=STRAY)
    (moved,) = log.replace("p_g0", 1)
    assert said(store) == [stranded(finished, moved)]


def stranded(finished: int, moved: int) -> tuple[str, list[int], str]:
    """A receipt fetched with no debt owed, then replaced: what every test below that fetches p_g0's
    receipt reports besides."""
    return (
        NO_STRANDED_RESULT,
        [finished, moved],
        f"try p_g0#0 finished at the agent (position {finished}) but no ACK was ever owed for it; the "
        f"trainer moved on at {moved} and left the result stranded",
    )


def may_still_run(rollout_id: str, dispatched: int, replaced: int) -> tuple[str, list[int], str]:
    return (
        RETIRE_BEFORE_REPLACE,
        [dispatched, replaced],
        f"{rollout_id}#1 was minted while #0 may still be running at the agent: no retire answer, "
        "ACK debt or agent restart precedes it",
    )


def test_a_try_keeps_the_agent_it_was_dispatched_to_when_another_fetches_its_receipt(
    store: EventStore, log: LogBuilder
) -> None:
    """Dispatched to `a`, its receipt fetched under `b`'s process 1; `a` later shows process 2. The
    try ran at `a`, whose process changed: nothing runs there any more."""
    log.reserve("p", 2)
    log.mint("p", 2)
    dispatch_to(log, "p_g0", "a")
    finished = fetch(log, "p_g0", "b", 1)
    fetch(log, "p_g1", "a", 2)
    (moved,) = log.replace("p_g0", 1)
    assert said(store) == [stranded(finished, moved)]


def test_a_try_whose_agent_shows_no_process_is_not_taken_as_restarted(
    store: EventStore, log: LogBuilder
) -> None:
    """Dispatched to `a`, which never shows a process; its receipt came under `b`'s process 1: no
    restart of `a` is on the log, so the try may still run there."""
    log.reserve("p", 2)
    log.mint("p", 2)
    dispatched = dispatch_to(log, "p_g0", "a")
    finished = fetch(log, "p_g0", "b", 1)
    (replaced,) = log.replace("p_g0", 1)
    assert said(store) == [may_still_run("p_g0", dispatched, replaced), stranded(finished, replaced)]


def test_a_debt_owed_under_the_dispatching_agent_shows_its_new_process(
    store: EventStore, log: LogBuilder
) -> None:
    """`a` shows process 1 by a receipt, then process 2 by a debt owed with no receipt fetched (a
    violation of its own): the try it ran under process 1 runs no more."""
    log.reserve("p", 2)
    log.mint("p", 2)
    dispatch_to(log, "p_g0", "a")
    finished = fetch(log, "p_g0", "a", 1)
    dispatch_to(log, "p_g1", "a")
    (owed,) = log.group("p", [AckOwed(agent_name="a", receipt=completion_receipt("p_g1", 0, generation=2))])
    (moved,) = log.replace("p_g0", 1)
    never_fetched = "AckOwed for p_g1#0, whose completion receipt was never fetched and checked"
    assert said(store) == [stranded(finished, moved), (RECEIPT_MATCHES, [owed], never_fetched)]


def test_a_process_shown_by_two_agents_is_each_ones_own(store: EventStore, log: LogBuilder) -> None:
    """`b` runs p_g0 under process 1; `a` shows process 2; then `b` shows process 2 too (a name both
    agents' processes happen to carry): `b` restarted, whatever `a` showed."""
    log.reserve("p", 3)
    log.mint("p", 3)
    dispatch_to(log, "p_g0", "b")
    finished = fetch(log, "p_g0", "b", 1)
    fetch(log, "p_g1", "a", 2)
    fetch(log, "p_g2", "b", 2)
    (moved,) = log.replace("p_g0", 1)
    assert said(store) == [stranded(finished, moved)]


def test_an_old_process_reappearing_after_a_restart_is_not_the_agents_newest(
    store: EventStore, log: LogBuilder
) -> None:
    """`a` runs p_g0 under process 1, restarts as process 2, then a late receipt of process 1 comes:
    the agent is still process 2, so p_g0's process is gone."""
    log.reserve("p", 3)
    log.mint("p", 3)
    dispatch_to(log, "p_g0", "a")
    finished = fetch(log, "p_g0", "a", 1)
    fetch(log, "p_g1", "a", 2)
    fetch(log, "p_g2", "a", 1)
    (moved,) = log.replace("p_g0", 1)
    assert said(store) == [stranded(finished, moved)]


def test_replacements_out_of_order_then_one_in_order(store: EventStore, log: LogBuilder) -> None:
    """#2 replaces #0 (a skip), #1 replaces #0 (behind the newest): each a violation, and the sibling's
    newest try stays #2, so #3 replacing #2 is in order."""
    log.reserve("p", 2, max_tries=8)
    (minted, _) = log.mint("p", 2)
    (skip,) = log.group("p", [replacement("p_g0", 2, 0)])
    (behind,) = log.group("p", [replacement("p_g0", 1, 0)])
    log.group("p", [replacement("p_g0", 3, 2)])
    out_of_order = "a replacement's index must be exactly the previous one + 1"
    assert said(store) == [
        (
            NO_REUSED_TRY,
            [minted, skip],
            f"replacement p_g0#2 replaces #0, but the sibling's newest try is #0: {out_of_order}",
        ),
        (
            NO_REUSED_TRY,
            [skip, behind],
            f"replacement p_g0#1 replaces #0, but the sibling's newest try is #2: {out_of_order}",
        ),
    ]


def test_a_version_2_commit_naming_another_trainer_than_its_prepare(
    store: EventStore, log: LogBuilder
) -> None:
    """An older trainer's commit (version 2: no `carried`) still names its trainer, so a wrong one is
    told."""
    (prepared,) = log.prepare("c1", trainer="T2")
    data = {
        "checkpoint_id": "c1",
        "participants": [log.agent],
        "cut_position": store.head(),
        "prepare_wait_s": {log.agent: 0.25},
        "trainer_id": "T1",
    }
    (committed,) = store.append(
        checkpoint_stream("c1"), [NewEvent(type="CheckpointCommitted", data=data, schema_version=2)]
    ).positions
    assert said(store) == [
        (
            ARCHIVED_BY_OWN_CUT,
            [prepared, committed],
            "checkpoint c1 was prepared by trainer 'T2' but its commit names trainer 'T1': the ledger would "
            "archive that trainer's groups at a cut it never took",
        ),
    ]
