"""The rules on results and their debts, each violation with its message: a debt owed for a try never
minted, never fetched, or for another receipt than the one fetched or another digest than the reply's; a
sibling sealed twice; an ACK with no debt owed (an ACK of a try nobody minted too), which still settles
the try."""

from __future__ import annotations

from eventstore import EventStore
from eventstore.events import AckAccepted, AckOwed, ReceiptFetched, SiblingSealed
from projections.audit import GROUP_SEAL_COMPLETE, RECEIPT_MATCHES, SEAL_BEFORE_ACK
from protocol.streams import group_stream
from tests.projections.audit_fold import audit_both_ways
from tests.projections.builder import LogBuilder, completion_receipt, digest_of, rollout_receipt


def said(store: EventStore) -> list[tuple[str, list[int], str]]:
    return [(v.rule, v.positions, v.message) for v in audit_both_ways(store).violations]


def test_debts_owed_for_no_try_an_unfetched_one_or_another_receipt(
    store: EventStore, log: LogBuilder
) -> None:
    log.reserve("p", 2)
    log.mint("p", 2)
    (ghost,) = log.group("p", [AckOwed(agent_name="agent-a", receipt=completion_receipt("p_g7", 0))])
    log.dispatch("p_g0")
    (unfetched,) = log.group("p", [AckOwed(agent_name="agent-a", receipt=completion_receipt("p_g0", 0))])
    log.dispatch("p_g1")
    (fetched,) = log.group("p", [ReceiptFetched(agent_name="agent-a", receipt=completion_receipt("p_g1", 0))])
    (elsewhere,) = log.group("p", [AckOwed(agent_name="agent-b", receipt=completion_receipt("p_g1", 0))])
    assert said(store) == [
        (RECEIPT_MATCHES, [ghost], "AckOwed for p_g7#0, a try that was never minted"),
        (
            RECEIPT_MATCHES,
            [unfetched],
            "AckOwed for p_g0#0, whose completion receipt was never fetched and checked",
        ),
        (
            RECEIPT_MATCHES,
            [fetched, elsewhere],
            f"the receipt owed for p_g1#0 differs from the one fetched at {fetched}",
        ),
    ]


def test_a_debt_for_another_digest_than_the_reply_had(store: EventStore, log: LogBuilder) -> None:
    log.reserve("p", 1)
    log.mint("p", 1)
    log.dispatch("p_g0")
    (replied,) = log.reply("p_g0")
    wrong = completion_receipt("p_g0", 0, digest="sha256:" + "1" * 64)
    (_, owed) = log.group(
        "p",
        [ReceiptFetched(agent_name="agent-a", receipt=wrong), AckOwed(agent_name="agent-a", receipt=wrong)],
    )
    log.ack("p_g0")
    assert said(store) == [
        (
            RECEIPT_MATCHES,
            [replied, owed],
            f"the receipt owed for p_g0#0 has digest sha256:{'1' * 64}, the reply had {digest_of('p_g0', 0)}",
        )
    ]


def test_a_sibling_sealed_twice(store: EventStore, log: LogBuilder) -> None:
    log.reserve("p", 1)
    log.mint("p", 1)
    log.dispatch("p_g0")
    log.reply("p_g0")
    first = log.seal("p_g0")[1]
    log.ack("p_g0")
    (again, _) = log.group(
        "p",
        [
            SiblingSealed(rollout_id="p_g0", attempt_index=0, reward=1.0, receipt=rollout_receipt("p_g0", 0)),
            AckOwed(agent_name="agent-a", receipt=completion_receipt("p_g0", 0)),
        ],
    )
    log.seal_group("p", {0: 0})
    assert said(store) == [
        (GROUP_SEAL_COMPLETE, [first, again], f"p_g0 is sealed a second time at {again} (first at {first})"),
    ]


def test_an_ack_with_no_debt_still_settles_its_try(store: EventStore, log: LogBuilder) -> None:
    """The ACK went out before its debt was durable (a violation), but the agent took the result: the try
    is settled, not stranded, when its group is later dead-lettered."""
    log.reserve("p", 1)
    log.mint("p", 1)
    log.dispatch("p_g0")
    log.reply("p_g0")
    (fetched,) = log.group("p", [ReceiptFetched(agent_name="agent-a", receipt=completion_receipt("p_g0", 0))])
    (acked,) = log.ack("p_g0")
    (stray,) = log.append(
        group_stream("p"), [AckAccepted(rollout_id="p_g9", attempt_index=0, idempotent=False)]
    )
    log.dead_letter("p", {0: 0})
    unrecorded = "an ACK was sent for a receipt the trainer had not durably recorded"
    assert said(store) == [
        (
            SEAL_BEFORE_ACK,
            [fetched, acked],
            f"AckAccepted for p_g0#0 with no AckOwed before it: {unrecorded}",
        ),
        (SEAL_BEFORE_ACK, [stray], f"AckAccepted for p_g9#0 with no AckOwed before it: {unrecorded}"),
    ]
