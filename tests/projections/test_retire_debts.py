"""Retire debts in the folds: the ledger keeps them until paid (and their groups in play), the
auditor names a stranded result with a retire owed, and clears one whose retire was answered."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from cli.main import app
from eventstore import EventStore, open_store
from eventstore.events import (
    AckOwed,
    OperatorMark,
    ReceiptFetched,
    RetireOwed,
    RetirePaid,
    RetirePaidOutcome,
    RunFailed,
)
from projections.audit import NO_STRANDED_RESULT, RECEIPT_MATCHES
from projections.base import decode, fold
from projections.figures import LogFigures
from projections.ledger import LedgerProjection, LedgerState
from projections.ownership import Driver
from protocol.streams import operator_stream
from protocol.wire import AttemptRef
from tests.projections.audit_fold import audit_both_ways
from tests.projections.builder import AGENT, LogBuilder, completion_receipt
from tests.projections.tamper import append_raw
from trainer.core.retire_debt import strays


def ledger_of(store: EventStore) -> LedgerState:
    return fold(LedgerProjection(), store.read_all())


def lost_after_finishing(log: LogBuilder, group_id: str) -> int:
    """One try finished at the agent (retire answered completed_unacknowledged), then declared lost
    with a retire owed, and its group dead-lettered; returns the RetireOwed's position."""
    rid = f"{group_id}_g0"
    log.reserve(group_id, 1)
    log.mint(group_id, 1)
    log.dispatch(rid)
    log.retire(rid, 0, "completed_unacknowledged")
    positions = log.group(
        group_id,
        [
            RunFailed(rollout_id=rid, attempt_index=0, reason="declared lost: away", kind="agent_lost"),
            RetireOwed(agent_name=AGENT, rollout_id=rid, attempt_index=0),
        ],
    )
    log.dead_letter(group_id, {0: 0})
    return positions[-1]


def pay(log: LogBuilder, group_id: str, outcome: RetirePaidOutcome) -> None:
    log.group(group_id, [RetirePaid(rollout_id=f"{group_id}_g0", attempt_index=0, outcome=outcome)])


def test_an_owed_retire_is_kept_until_paid_and_keeps_its_group_in_play(
    store: EventStore, log: LogBuilder
) -> None:
    owed_at = lost_after_finishing(log, "p")
    log.checkpoint("c1")
    log.checkpoint("c2")
    state = ledger_of(store)
    [debt] = state.retires[AGENT].values()
    assert (debt.rollout_id, debt.attempt_index, debt.position) == ("p_g0", 0, owed_at)
    assert "p" in state.groups  # dead-lettered, but not archived while a retire is owed
    pay(log, "p", "tombstoned")
    pay(log, "p", "tombstoned")  # paid twice (two processes): the fold records one payment
    log.checkpoint("c3")
    log.checkpoint("c4")
    state = ledger_of(store)
    assert state.retires == {} and "p" in state.archived


def test_the_audit_names_the_retire_owed_for_a_stranded_result(store: EventStore, log: LogBuilder) -> None:
    owed_at = lost_after_finishing(log, "p")
    [violation] = audit_both_ways(store).violations
    assert violation.rule == NO_STRANDED_RESULT and owed_at in violation.positions
    assert f"a retire is owed to its agent since position {owed_at}, not yet paid" in violation.message


@pytest.mark.parametrize("outcome", ["tombstoned", "done", "cancelled"])
def test_an_answered_retire_leaves_nothing_stranded(
    store: EventStore, log: LogBuilder, outcome: RetirePaidOutcome
) -> None:
    lost_after_finishing(log, "p")
    pay(log, "p", outcome)
    report = audit_both_ways(store)
    assert report.ok, report.as_json()


def test_a_released_result_is_stranded_until_its_ack_is_owed(store: EventStore, log: LogBuilder) -> None:
    """`released` says the agent still held the result: only the ACK debt recorded beside it (which the
    trainer always appends with it) keeps the audit clean."""
    lost_after_finishing(log, "p")
    pay(log, "p", "released")
    assert [v.rule for v in audit_both_ways(store).violations] == [NO_STRANDED_RESULT]
    log.owe("p_g0")
    log.ack("p_g0")
    report = audit_both_ways(store)
    assert report.ok, report.as_json()


def test_the_stranded_figure_counts_a_result_until_its_owed_retire_is_answered(
    store: EventStore, log: LogBuilder
) -> None:
    figures = LogFigures()
    lost_after_finishing(log, "p")
    assert figures.catch_up(store).stranded == 1
    pay(log, "p", "done")
    assert figures.catch_up(store).stranded == 0


def test_status_shows_the_retires_owed_until_paid(store_url: str) -> None:
    store = open_store(store_url)
    try:
        log = LogBuilder(store)
        owed_at = lost_after_finishing(log, "p")
        result = CliRunner().invoke(app, ["status", "--db", store_url])
        assert result.exit_code == 0, result.output
        assert "retires owed" in result.output and "p_g0 #0" in result.output
        assert str(owed_at) in result.output
        pay(log, "p", "tombstoned")
        result = CliRunner().invoke(app, ["status", "--db", store_url])
        assert result.exit_code == 0 and "retires owed" not in result.output, result.output
    finally:
        store.close()


def test_an_operator_drops_a_retire_owed_to_an_agent_gone_for_good(store_url: str) -> None:
    """`ledger debt drop` of a try with no ACK debt but a retire owed: `RetirePaid` dropped_by_operator
    with the operator's mark, on the operator's stream; the ledger no longer owes it (the relay stops
    calling), the auditor no longer names the result stranded, and a second drop finds nothing."""
    store = open_store(store_url)
    try:
        log = LogBuilder(store)
        lost_after_finishing(log, "p")
        assert NO_STRANDED_RESULT in {v.rule for v in audit_both_ways(store).violations}
        drop = ["debt", "drop", "p_g0", "0", "--reason", "agent host decommissioned"]
        result = CliRunner().invoke(app, [*drop, "--operator", "ops@host", "--db", store_url])
        assert result.exit_code == 0, result.output
        assert f"dropped the retire owed of p_g0#0 owed to {AGENT}" in result.output
        [row] = store.read_stream(operator_stream(AGENT))
        assert row.schema_version == RetirePaid.schema_version == 2
        assert row.metadata.get("writer") == "operator:ops@host"
        assert decode(row) == RetirePaid(
            rollout_id="p_g0",
            attempt_index=0,
            outcome="dropped_by_operator",
            operator=OperatorMark(operator="ops@host", reason="agent host decommissioned"),
        )
        assert ledger_of(store).retires == {}
        report = audit_both_ways(store)
        assert report.ok, report.as_json()
        assert LogFigures().catch_up(store).stranded == 0
        head = store.head()
        again = CliRunner().invoke(app, [*drop, "--db", store_url])
        assert again.exit_code == 2 and "no unpaid ACK debt and no retire owed" in again.output
        assert store.head() == head
    finally:
        store.close()


def test_a_retire_owed_to_another_agent_is_not_dropped(store_url: str) -> None:
    store = open_store(store_url)
    try:
        lost_after_finishing(LogBuilder(store), "p")
        head = store.head()
        args = ["debt", "drop", "p_g0", "0", "--agent", "agent-b", "--reason", "gone", "--db", store_url]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2 and "no retire owed for p_g0#0 to agent 'agent-b'" in result.output
        assert store.head() == head and ledger_of(store).retires
    finally:
        store.close()


def test_the_operators_mark_goes_with_a_dropped_retire_only() -> None:
    mark = OperatorMark(operator="ops", reason="gone")
    with pytest.raises(ValueError, match="operator's mark"):
        RetirePaid(rollout_id="p_g0", attempt_index=0, outcome="dropped_by_operator")
    with pytest.raises(ValueError, match="operator's mark"):
        RetirePaid(rollout_id="p_g0", attempt_index=0, outcome="done", operator=mark)


def test_a_v1_retire_paid_reads_as_v2_without_a_mark(store_url: str) -> None:
    """Stored rows are never rewritten: a v1 row is upcast on read, paid as it was."""
    store = open_store(store_url)
    try:
        lost_after_finishing(LogBuilder(store), "p")
        data = '{"rollout_id": "p_g0", "attempt_index": 0, "outcome": "tombstoned", "execution_incarnation": null}'
        position = append_raw(store, store_url, "group-p", "RetirePaid", 1, data)
        row = next(r for r in store.read_all(position - 1) if r.position == position)
        assert decode(row) == RetirePaid(
            rollout_id="p_g0", attempt_index=0, outcome="tombstoned", operator=None
        )
        assert ledger_of(store).retires == {}
    finally:
        store.close()


# --- stray results (trainer.core.retire_debt.strays) ---------------------------------------------

HOLDER = "c" * 32


def retired_then_replaced(log: LogBuilder, group_id: str, trainer: str | None = None) -> str:
    """Try 0 retired at the agent (cancelled), try 1 sealed with its ACK owed; returns the rollout id."""
    rid = f"{group_id}_g0"
    log.reserve(group_id, 1, trainer=trainer)
    log.mint(group_id, 1)
    log.dispatch(rid)
    log.replace(rid, 1, retire="cancelled")
    log.dispatch(rid, 1)
    log.seal(rid, 1)
    return rid


def strays_of(
    store: EventStore,
    held: list[tuple[str, int]],
    agent: str = AGENT,
    trainer: str | None = None,
    owed_before: frozenset[str] = frozenset(),
) -> list[tuple[str, str, int, str | None]]:
    found = strays(
        ledger_of(store),
        Driver.of(trainer, [AGENT, "agent-b"]),
        agent,
        HOLDER,
        [AttemptRef(rollout_id=rid, attempt_index=n) for rid, n in held],
        owed_before,
    )
    return [(e.agent_name, e.rollout_id, e.attempt_index, e.execution_incarnation) for e in found]


def test_a_retired_try_held_again_is_a_stray_owed_a_retire_once(store: EventStore, log: LogBuilder) -> None:
    rid = retired_then_replaced(log, "p")
    assert strays_of(store, [(rid, 0)]) == [(AGENT, rid, 0, HOLDER)]
    log.group("p", [RetireOwed(agent_name=AGENT, rollout_id=rid, attempt_index=0)])
    assert strays_of(store, [(rid, 0)]) == []  # owed already: recorded once


def test_only_a_settled_try_of_this_trainers_group_at_that_agent_is_a_stray(
    store: EventStore, log: LogBuilder
) -> None:
    rid = retired_then_replaced(log, "p", trainer="A")
    log.reserve("q", 1, trainer="A")
    log.mint("q", 1)
    log.dispatch("q_g0")
    assert strays_of(store, [(rid, 0)], trainer="A") == [(AGENT, rid, 0, HOLDER)]
    assert strays_of(store, [(rid, 0)], trainer="B") == []  # another trainer's group
    assert strays_of(store, [(rid, 0)], agent="agent-b", trainer="A") == []  # the try ran at another agent
    # The sealed replacement (its ACK owed), a try in flight, one never minted, a group never reserved.
    held = [(rid, 1), ("q_g0", 0), (rid, 5), ("zz_g0", 0)]
    assert strays_of(store, held, trainer="A") == []
    log.ack(rid, 1)
    # Sealed and ACKed, then held again: a stray, unless its ACK was owed when the agent was asked (the
    # agent answered before the ACK reached it, and the log folded the ACK before the answer was read).
    assert strays_of(store, [(rid, 1)], trainer="A") == [(AGENT, rid, 1, HOLDER)]
    assert strays_of(store, [(rid, 1)], trainer="A", owed_before=frozenset({f"{rid}/1"})) == []
    # Each held result is judged on its own: one passed over does not end the search.
    owed = frozenset({f"{rid}/1"})
    assert strays_of(store, [(rid, 1), (rid, 0)], trainer="A", owed_before=owed) == [(AGENT, rid, 0, HOLDER)]
    assert strays_of(store, [("zz_g0", 0), (rid, 1)], trainer="A") == [(AGENT, rid, 1, HOLDER)]


def test_a_failed_try_is_a_stray_once_its_group_is_dead_lettered(store: EventStore, log: LogBuilder) -> None:
    lost_after_finishing(log, "p")
    pay(log, "p", "tombstoned")  # the agent held nothing of it then
    assert strays_of(store, [("p_g0", 0)]) == [(AGENT, "p_g0", 0, HOLDER)]
    log.reserve("q", 1)
    log.mint("q", 1)
    log.dispatch("q_g0")
    log.fail("q_g0")
    assert strays_of(store, [("q_g0", 0)]) == []  # failed, its group still open: the trainer decides
    log.replace("q_g0", 1)
    assert strays_of(store, [("q_g0", 0)]) == [(AGENT, "q_g0", 0, HOLDER)]  # its sibling moved on


def test_a_try_of_an_archived_group_held_again_is_a_stray(store: EventStore, log: LogBuilder) -> None:
    rid = retired_then_replaced(log, "p")
    log.ack(rid, 1)
    log.seal_group("p", {0: 1})
    log.claim("p", 1)
    log.checkpoint("c1")
    log.checkpoint("c2")
    assert "p" in ledger_of(store).archived
    assert strays_of(store, [(rid, 1), (rid, 0)]) == [(AGENT, rid, 1, HOLDER), (AGENT, rid, 0, HOLDER)]


def test_a_stray_being_released_is_not_owed_again_until_its_ack_is_accepted(
    store: EventStore, log: LogBuilder
) -> None:
    rid = retired_then_replaced(log, "p")
    log.group("p", [RetireOwed(agent_name=AGENT, rollout_id=rid, attempt_index=0)])
    log.owe(rid, 0)
    pay_stray = RetirePaid(rollout_id=rid, attempt_index=0, outcome="released")
    log.group("p", [pay_stray])
    assert strays_of(store, [(rid, 0)]) == []  # its ACK is owed: the relay releases it
    log.ack(rid, 0)
    # Released, then held again (the agent lost its state once more): a stray again.
    assert strays_of(store, [(rid, 0)]) == [(AGENT, rid, 0, HOLDER)]


def test_a_stray_released_is_judged_as_a_release_not_against_the_sealed_reply(
    store: EventStore, log: LogBuilder
) -> None:
    """A sealed try run again by an agent that lost its state: the receipt fetched to release it is
    another execution's (another digest); the audit accepts the release, and still checks ACKs owed
    outside one."""
    log.reserve("p", 1)
    log.mint("p", 1)
    log.dispatch("p_g0")
    log.reply("p_g0")
    log.seal("p_g0")
    log.ack("p_g0")
    again = completion_receipt("p_g0", 0, digest="sha256:" + "e" * 64, generation=2)
    log.group("p", [RetireOwed(agent_name=AGENT, rollout_id="p_g0", attempt_index=0)])
    log.group(
        "p",
        [
            ReceiptFetched(agent_name=AGENT, receipt=again),
            AckOwed(agent_name=AGENT, receipt=again),
            RetirePaid(rollout_id="p_g0", attempt_index=0, outcome="released"),
        ],
    )
    log.ack("p_g0")
    report = audit_both_ways(store)
    assert report.ok, report.as_json()
    # The same receipt owed with no retire owed for the try: the reply's digest is checked.
    log.group(
        "p", [ReceiptFetched(agent_name=AGENT, receipt=again), AckOwed(agent_name=AGENT, receipt=again)]
    )
    [violation] = audit_both_ways(store).violations
    assert violation.rule == RECEIPT_MATCHES and "the reply had" in violation.message
