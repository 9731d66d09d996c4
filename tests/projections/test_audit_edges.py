"""Rows the audit must take in stride, each with what it reports: rows naming a group or try the log
never reserved or minted; a rejection of a try with no debt, which still frees it; a retire owed again
after it was paid; a try finished only by its fetched receipt; a prompt group at level turn rerun for
a masked reply (a failure of its own) or for none (the message, its reason capped)."""

from __future__ import annotations

from eventstore import EventStore
from eventstore.events import (
    AckOwed,
    AckRejected,
    CheckpointResumed,
    GroupAbandoned,
    GroupDeadLettered,
    OperatorMark,
    ReceiptFetched,
    RetireOwed,
    RetirePaid,
    RunFailed,
    SiblingHeld,
    SiblingSealed,
)
from projections.audit import (
    CHECKPOINT_CLEAN,
    DEBT_DROPPED_ON_EVIDENCE,
    NO_STRANDED_RESULT,
    RECEIPT_MATCHES,
    RESUMED_BY_EVERY_PARTICIPANT,
    ROUND_KEPT_AT_TURN,
    SEAL_BEFORE_ACK,
)
from protocol.streams import checkpoint_stream
from protocol.wire import AttemptRef
from tests.projections.audit_fold import audit_both_ways
from tests.projections.builder import AGENT, LogBuilder, completion_receipt, rollout_receipt
from tests.projections.test_retire_debts import lost_after_finishing, pay


def said(store: EventStore) -> list[tuple[str, list[int], str]]:
    return [(v.rule, v.positions, v.message) for v in audit_both_ways(store).violations]


def test_rows_of_a_group_never_reserved(store: EventStore, log: LogBuilder) -> None:
    receipt = completion_receipt("ghost_g0", 0)
    (_, owed) = log.group(
        "ghost",
        [ReceiptFetched(agent_name=AGENT, receipt=receipt), AckOwed(agent_name=AGENT, receipt=receipt)],
    )
    log.group(
        "ghost", [SiblingHeld(rollout_id="ghost_g0", attempt_index=0, receipt=rollout_receipt("ghost_g0", 0))]
    )
    log.group("ghost", [RunFailed(rollout_id="ghost_g0", attempt_index=0, reason="x", kind="refused")])
    log.group("ghost", [RetirePaid(rollout_id="ghost_g0", attempt_index=0, outcome="done")])
    ref = AttemptRef(rollout_id="ghost_g0", attempt_index=0)
    log.group("ghost", [GroupDeadLettered(group_id="ghost", attempts=[ref], reasons=["x"])])
    assert said(store) == [(RECEIPT_MATCHES, [owed], "AckOwed for ghost_g0#0, a try that was never minted")]


def test_a_rejection_of_a_try_with_no_debt_still_frees_it(store: EventStore, log: LogBuilder) -> None:
    log.reserve("p", 2)
    log.mint("p", 2)
    log.dispatch("p_g0")
    (unknown,) = log.reject("p_g0", agent_generation=None)
    log.replace("p_g0", 1, reason="lost")
    (never_minted,) = log.group(
        "p",
        [AckRejected(rollout_id="p_g9", attempt_index=0, error="unknown_execution", agent_generation=None)],
    )
    no_debt = "with no AckOwed before it: an ACK was sent for a receipt the trainer had not durably recorded"
    no_evidence = (
        "was dropped on an unknown_execution with no agent incarnation recorded: nothing shows the agent "
        "restarted and lost the result"
    )
    assert said(store) == [
        (DEBT_DROPPED_ON_EVIDENCE, [unknown], f"the debt of p_g0#0 {no_evidence}"),
        (SEAL_BEFORE_ACK, [unknown], f"AckRejected for p_g0#0 {no_debt}"),
        (DEBT_DROPPED_ON_EVIDENCE, [never_minted], f"the debt of p_g9#0 {no_evidence}"),
        (SEAL_BEFORE_ACK, [never_minted], f"AckRejected for p_g9#0 {no_debt}"),
    ]


def test_a_retire_owed_again_after_it_was_paid_is_a_new_debt(store: EventStore, log: LogBuilder) -> None:
    lost_after_finishing(log, "p")
    pay(log, "p", "tombstoned")
    assert said(store) == []
    (again,) = log.group("p", [RetireOwed(agent_name=AGENT, rollout_id="p_g0", attempt_index=0)])
    [(rule, positions, message)] = said(store)
    assert rule == NO_STRANDED_RESULT and again in positions
    assert message.endswith(f"; a retire is owed to its agent since position {again}, not yet paid")


def test_a_try_finished_at_its_fetched_receipt(store: EventStore, log: LogBuilder) -> None:
    """No reply recorded (a lost reply, its receipt fetched on a later look): finished at the fetch."""
    log.reserve("p", 1)
    log.mint("p", 1)
    log.dispatch("p_g0")
    (fetched,) = log.group("p", [ReceiptFetched(agent_name=AGENT, receipt=completion_receipt("p_g0", 0))])
    (dead,) = log.dead_letter("p", {0: 0})
    assert [(rule, positions) for rule, positions, _ in said(store)] == [
        (NO_STRANDED_RESULT, [fetched, dead])
    ]


def test_a_round_at_level_turn_rerun_for_a_masked_reply_or_for_nothing(
    store: EventStore, log: LogBuilder
) -> None:
    log.reserve("t", 1, mode="prompt_group", target_level="turn")
    log.mint("t", 1)
    log.dispatch("t_g0")
    log.reply("t_g0", mask=True)  # the try's own failure
    log.owe("t_g0")
    log.ack("t_g0")
    log.abandon("t", {0: 0})
    assert said(store) == []
    log.reserve("u", 1, mode="prompt_group", target_level="turn")
    log.mint("u", 1)
    log.dispatch("u_g0")
    log.retire("u_g0", 0, "cancelled")
    reason = "r" * 250
    (abandoned,) = log.group(
        "u",
        [
            GroupAbandoned(
                group_id="u", reason=reason, attempts=[AttemptRef(rollout_id="u_g0", attempt_index=0)]
            )
        ],
    )
    assert said(store) == [
        (
            ROUND_KEPT_AT_TURN,
            [abandoned],
            f"group u runs at level turn, yet its round was rerun whole for no failure of its own ({'r' * 200}): "
            "an interrupted sibling is replaced alone, its finished siblings kept",
        )
    ]


def test_a_try_sealed_or_held_with_no_reply_or_receipt_before_it_finished_there(
    store: EventStore, log: LogBuilder
) -> None:
    log.reserve("p", 1)
    log.mint("p", 1)
    log.dispatch("p_g0")
    (sealed,) = log.group(
        "p",
        [SiblingSealed(rollout_id="p_g0", attempt_index=0, reward=1.0, receipt=rollout_receipt("p_g0", 0))],
    )
    (dead,) = log.dead_letter("p", {0: 0})
    log.reserve("q", 1, mode="prompt_group")
    log.mint("q", 1)
    log.dispatch("q_g0")
    (held,) = log.group(
        "q", [SiblingHeld(rollout_id="q_g0", attempt_index=0, receipt=rollout_receipt("q_g0", 0))]
    )
    (q_dead,) = log.dead_letter("q", {0: 0})
    stranded = [positions for rule, positions, _ in said(store) if rule == NO_STRANDED_RESULT]
    assert stranded == [[sealed, dead], [held, q_dead]]


def test_an_operators_drop_of_a_try_with_no_debt_frees_it(store: EventStore, log: LogBuilder) -> None:
    log.reserve("p", 1)
    log.mint("p", 1)
    log.dispatch("p_g0")
    mark = OperatorMark(operator="ops@host", reason="agent host decommissioned")
    (dropped,) = log.group(
        "p", [AckRejected(rollout_id="p_g0", attempt_index=0, error="dropped_by_operator", operator=mark)]
    )
    log.replace("p_g0", 1, reason="dropped")
    assert [(rule, positions) for rule, positions, _ in said(store)] == [(SEAL_BEFORE_ACK, [dropped])]


def test_a_resume_alone_of_a_checkpoint_never_seen(store: EventStore, log: LogBuilder) -> None:
    (resumed,) = log.append(
        checkpoint_stream("c8"), [CheckpointResumed(checkpoint_id="c8", participants=["agent-a"])]
    )
    assert [(rule, positions) for rule, positions, _ in said(store)] == [
        (CHECKPOINT_CLEAN, [resumed]),
        (RESUMED_BY_EVERY_PARTICIPANT, [resumed]),
    ]
