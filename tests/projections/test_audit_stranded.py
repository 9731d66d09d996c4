"""The checks at the end of the log (`AuditProjection.finish`): each try that finished at its agent and was
never owed is judged on its own, whatever the tries before it were (settled, tombstoned after finishing,
lost with the process that held it, its owed retire answered); a log that ends on a seal without its
debt."""

from __future__ import annotations

import pytest

from eventstore import EventStore
from eventstore.events import AttemptRetired, ReceiptFetched, RetireOwed, RetirePaid, SiblingSealed
from projections.audit import DEBT_WITH_RESULT, NO_STRANDED_RESULT
from tests.projections.audit_fold import audit_both_ways
from tests.projections.builder import AGENT, LogBuilder, completion_receipt, rollout_receipt

INC_1, INC_2 = "1" * 32, "2" * 32  # two agent processes (incarnations)


def said(store: EventStore) -> list[tuple[str, list[int], str]]:
    return [(v.rule, v.positions, v.message) for v in audit_both_ways(store).violations]


def finished_unowed(log: LogBuilder, rollout_id: str) -> int:
    """The try replied (it finished there) and its receipt was fetched, but no debt was recorded: the
    reply's position."""
    log.dispatch(rollout_id)
    (replied,) = log.reply(rollout_id)
    log.group(
        rollout_id.rpartition("_g")[0],
        [ReceiptFetched(agent_name=AGENT, receipt=completion_receipt(rollout_id, 0))],
    )
    return replied


def settled(log: LogBuilder, how: str) -> None:
    """p_g0 finished, then left nothing at its agent in one of the ways the audit accepts."""
    if how == "acked":
        log.dispatch("p_g0")
        log.reply("p_g0")
        log.seal("p_g0")
        log.ack("p_g0")
    elif how == "tombstoned after finishing":
        finished_unowed(log, "p_g0")
        log.retire("p_g0", 0, "tombstoned")
    elif how == "lost with its process":
        finished_unowed(log, "p_g0")
        log.retire("p_g0", 0, "done", generation=2)  # another process answered: the holder is gone
    elif how == "owed retire answered":
        finished_unowed(log, "p_g0")
        log.group("p", [RetireOwed(agent_name=AGENT, rollout_id="p_g0", attempt_index=0)])
        log.group("p", [RetirePaid(rollout_id="p_g0", attempt_index=0, outcome="done")])


@pytest.mark.parametrize(
    "how", ["acked", "tombstoned after finishing", "lost with its process", "owed retire answered"]
)
def test_a_stranded_try_is_reported_whatever_the_try_before_it(
    store: EventStore, log: LogBuilder, how: str
) -> None:
    log.reserve("p", 2)
    log.mint("p", 2)
    settled(log, how)
    replied = finished_unowed(log, "p_g1")
    (dead,) = log.dead_letter("p", {0: 0, 1: 0})
    assert said(store) == [
        (
            NO_STRANDED_RESULT,
            [replied, dead],
            f"try p_g1#0 finished at the agent (position {replied}) but no ACK was ever owed for it; the trainer "
            f"moved on at {dead} and left the result stranded",
        )
    ]


def test_a_log_ending_on_a_seal_without_its_debt(store: EventStore, log: LogBuilder) -> None:
    log.reserve("p", 1)
    log.mint("p", 1)
    log.dispatch("p_g0")
    log.reply("p_g0")
    (_, sealed) = log.group(
        "p",
        [
            ReceiptFetched(agent_name=AGENT, receipt=completion_receipt("p_g0", 0)),
            SiblingSealed(rollout_id="p_g0", attempt_index=0, reward=1.0, receipt=rollout_receipt("p_g0", 0)),
        ],
    )
    assert said(store) == [
        (
            DEBT_WITH_RESULT,
            [sealed],
            f"try p_g0#0 was held or sealed at {sealed} without its ACK debt: its AckOwed is not in the append "
            "that records the result (a crash after it would leave a result the log never owes)",
        )
    ]


def fetched_from(log: LogBuilder, rollout_id: str, incarnation: str) -> int:
    """The try replied, and its receipt from agent process `incarnation` (generation 1) was fetched."""
    log.dispatch(rollout_id)
    (replied,) = log.reply(rollout_id)
    receipt = completion_receipt(rollout_id, 0).model_copy(update={"execution_incarnation": incarnation})
    log.group(rollout_id.rpartition("_g")[0], [ReceiptFetched(agent_name=AGENT, receipt=receipt)])
    return replied


def retired_done_by(log: LogBuilder, rollout_id: str, incarnation: str, generation: int | None) -> None:
    log.group(
        rollout_id.rpartition("_g")[0],
        [
            AttemptRetired(
                rollout_id=rollout_id,
                attempt_index=0,
                outcome="done",
                execution_incarnation=incarnation,
                execution_generation=generation,
            )
        ],
    )


def test_the_process_that_answers_a_retire_is_told_by_its_incarnation(
    store: EventStore, log: LogBuilder
) -> None:
    """`done` from another incarnation (no generation recorded): the process that held p_g0's result is
    gone with it.  `done` from the incarnation that made p_g1's receipt (whatever its generation): the
    result is still there, stranded."""
    log.reserve("p", 2)
    log.mint("p", 2)
    fetched_from(log, "p_g0", INC_1)
    retired_done_by(log, "p_g0", INC_2, None)
    replied = fetched_from(log, "p_g1", INC_1)
    retired_done_by(log, "p_g1", INC_1, 2)
    (dead,) = log.dead_letter("p", {0: 0, 1: 0})
    assert [(rule, positions) for rule, positions, _ in said(store)] == [
        (NO_STRANDED_RESULT, [replied, dead])
    ]
