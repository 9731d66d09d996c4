"""The rules on minting tries, each violation with its message: a try minted again, a replacement of a
sibling never minted or at the wrong index, a try past its budget (of its sibling or of its group), after
its group was dead-lettered or after the agent refused the request; a replacement minted while the old try
may still run, or instead of adopting a finished one; a dispatch of a try never minted."""

from __future__ import annotations

from eventstore import EventStore
from eventstore.events import AttemptMinted, AttemptRetired, ReceiptFetched, ReplacementMinted, RunDispatched
from projections.audit import BOUNDED_RETRIES, NO_REUSED_TRY, NO_STRANDED_RESULT, RETIRE_BEFORE_REPLACE
from tests.projections.audit_fold import audit_both_ways
from tests.projections.builder import LogBuilder, completion_receipt

INC_1, INC_2 = "1" * 32, "2" * 32  # two agent processes (incarnations)


def said(store: EventStore) -> list[tuple[str, list[int], str]]:
    return [(v.rule, v.positions, v.message) for v in audit_both_ways(store).violations]


def test_a_try_minted_again_or_replaced_at_another_index_or_never_minted(
    store: EventStore, log: LogBuilder
) -> None:
    log.reserve("p", 1)
    (first,) = log.mint("p", 1)
    (again,) = log.group("p", [AttemptMinted(rollout_id="p_g0", generation_index=0)])
    (skip,) = log.group(
        "p",
        [ReplacementMinted(rollout_id="p_g0", generation_index=0, attempt_index=2, replaces=1, reason="x")],
    )
    (ghost,) = log.group(
        "p",
        [ReplacementMinted(rollout_id="p_g7", generation_index=7, attempt_index=1, replaces=0, reason="x")],
    )
    (unminted,) = log.group(
        "p", [RunDispatched(rollout_id="p_g8", attempt_index=0, capture_key="k", agent_name="a")]
    )
    assert said(store) == [
        (NO_REUSED_TRY, [first, again], f"try p_g0#0 is minted again at {again}, first minted at {first}"),
        (
            NO_REUSED_TRY,
            [first, skip],
            "replacement p_g0#2 replaces #1, but the sibling's newest try is #0: a replacement's index must be "
            "exactly the previous one + 1",
        ),
        (NO_REUSED_TRY, [ghost], "replacement p_g7#1 for a sibling that was never minted"),
        (NO_REUSED_TRY, [unminted], "p_g8#0 is dispatched but never minted"),
    ]


def test_a_replacement_follows_the_newest_try(store: EventStore, log: LogBuilder) -> None:
    """After #1 replaced #0, #2 replaces #1: the newest try moved on (and the generation is the sibling's)."""
    log.reserve("p", 2, max_tries=4)
    log.mint("p", 2)
    for index in range(2):
        log.dispatch("p_g1", index)
        log.fail("p_g1", index)
        log.replace("p_g1", index + 1, retire="cancelled")
    log.dispatch("p_g1", 2)
    log.reply("p_g1", 2)
    log.seal("p_g1", 2)
    log.ack("p_g1", 2)
    assert said(store) == []


def test_a_try_past_its_siblings_budget_or_its_groups(store: EventStore, log: LogBuilder) -> None:
    log.reserve("s", 1, max_tries=1)
    log.mint("s", 1)
    log.dispatch("s_g0")
    log.fail("s_g0")
    (sibling,) = log.replace("s_g0", 1, retire="cancelled")[-1:]
    log.reserve("g", 1, mode="prompt_group", max_tries=1)
    log.mint("g", 1)
    log.dispatch("g_g0")
    log.fail("g_g0")
    log.retire("g_g0", 0, "cancelled")
    log.abandon("g", {0: 0})
    (group,) = log.replace("g_g0", 1, reason="group abandoned")
    past = "(and 0 tries lost to checkpoints); the group should have been dead-lettered"
    assert said(store) == [
        (BOUNDED_RETRIES, [sibling], f"try s_g0#1 is try 2 of its sibling, past the budget of 1 {past}"),
        (BOUNDED_RETRIES, [group], f"try g_g0#1 is try 2 of its group, past the budget of 1 {past}"),
    ]


def test_a_try_minted_after_its_group_was_dead_lettered(store: EventStore, log: LogBuilder) -> None:
    log.reserve("p", 1, max_tries=4)
    log.mint("p", 1)
    log.dispatch("p_g0")
    log.fail("p_g0")
    log.retire("p_g0", 0, "cancelled")
    (dead,) = log.dead_letter("p", {0: 0})
    (after,) = log.replace("p_g0", 1)
    assert said(store) == [
        (BOUNDED_RETRIES, [dead, after], "try p_g0#1 is minted after group p was dead-lettered"),
    ]


def test_a_refused_request_is_not_sent_again_but_another_sibling_is_minted(
    store: EventStore, log: LogBuilder
) -> None:
    log.reserve("p", 2)
    log.group("p", [AttemptMinted(rollout_id="p_g0", generation_index=0)])
    log.dispatch("p_g0")
    (refused,) = log.fail("p_g0", kind="refused")
    log.retire("p_g0", 0, "tombstoned")
    log.group("p", [AttemptMinted(rollout_id="p_g1", generation_index=1)])  # a first try: not a retry
    assert said(store) == []
    (again,) = log.replace("p_g0", 1)
    assert said(store) == [
        (
            BOUNDED_RETRIES,
            [refused, again],
            f"try p_g0#1 is minted after the agent refused a try of group p as a request it can never serve "
            f"(at {refused}): the same request is retried",
        )
    ]


def test_a_replacement_while_the_old_try_may_run_or_instead_of_adopting_it(
    store: EventStore, log: LogBuilder
) -> None:
    log.reserve("p", 2)
    log.mint("p", 2)
    (dispatched,) = log.dispatch("p_g0")
    log.fail("p_g0")
    (running,) = log.replace("p_g0", 1)
    log.dispatch("p_g1")
    log.fail("p_g1")
    (retired,) = log.retire("p_g1", 0, "completed_unacknowledged")
    (stranded,) = log.replace("p_g1", 1)
    assert said(store) == [
        (
            RETIRE_BEFORE_REPLACE,
            [dispatched, running],
            "p_g0#1 was minted while #0 may still be running at the agent: no retire answer, ACK debt or agent "
            "restart precedes it",
        ),
        (
            NO_STRANDED_RESULT,
            [retired, stranded],
            f"try p_g1#0 finished at the agent (position {retired}) but no ACK was ever owed for it; the trainer "
            f"moved on at {stranded} and left the result stranded",
        ),
        (
            RETIRE_BEFORE_REPLACE,
            [retired, stranded],
            f"p_g1#0 answered completed_unacknowledged at {retired}, yet a replacement was minted instead of "
            "adopting it: its result strands in the agent",
        ),
    ]


def retired_by_checkpoint(log: LogBuilder, rollout_id: str, index: int) -> None:
    log.dispatch(rollout_id, index)
    log.group(
        rollout_id.rpartition("_g")[0],
        [AttemptRetired(rollout_id=rollout_id, attempt_index=index, outcome="cancelled", cause="checkpoint")],
    )


def test_tries_a_checkpoint_retired_are_not_spent_of_the_siblings_budget(
    store: EventStore, log: LogBuilder
) -> None:
    """Budget 1: #0 and #1 retired by checkpoints' prepares, so #2 is the sibling's one try; #3 is past
    it, and the message counts the tries lost.  Another sibling's losses are its own."""
    log.reserve("s", 2, max_tries=1)
    log.mint("s", 2)
    retired_by_checkpoint(log, "s_g0", 0)
    log.replace("s_g0", 1)
    retired_by_checkpoint(log, "s_g0", 1)
    log.replace("s_g0", 2)
    log.dispatch("s_g0", 2)
    log.fail("s_g0", 2)
    (past,) = log.replace("s_g0", 3, retire="cancelled")[-1:]
    log.dispatch("s_g1")
    log.fail("s_g1")
    (other,) = log.replace("s_g1", 1, retire="cancelled")[-1:]
    dead = "the group should have been dead-lettered"
    assert said(store) == [
        (
            BOUNDED_RETRIES,
            [past],
            f"try s_g0#3 is try 4 of its sibling, past the budget of 1 (and 2 tries lost to checkpoints); {dead}",
        ),
        (
            BOUNDED_RETRIES,
            [other],
            f"try s_g1#1 is try 2 of its sibling, past the budget of 1 (and 0 tries lost to checkpoints); {dead}",
        ),
    ]


def test_rounds_a_checkpoint_retired_are_not_spent_of_the_groups_budget(
    store: EventStore, log: LogBuilder
) -> None:
    """A prompt group's round lost to a checkpoint counts once, however many of its siblings it retired."""
    log.reserve("g", 2, mode="prompt_group", max_tries=1)
    log.mint("g", 2)
    retired_by_checkpoint(log, "g_g0", 0)
    retired_by_checkpoint(log, "g_g1", 0)
    log.abandon("g", {0: 0, 1: 0})
    log.replace("g_g0", 1, reason="group abandoned")
    log.replace("g_g1", 1, reason="group abandoned")
    for i in range(2):
        log.dispatch(f"g_g{i}", 1)
        log.fail(f"g_g{i}", 1)
        log.retire(f"g_g{i}", 1, "cancelled")
    log.abandon("g", {0: 1, 1: 1})
    (past,) = log.replace("g_g0", 2, reason="group abandoned")
    assert said(store) == [
        (
            BOUNDED_RETRIES,
            [past],
            "try g_g0#2 is try 3 of its group, past the budget of 1 (and 1 tries lost to checkpoints); the group "
            "should have been dead-lettered",
        )
    ]


def test_an_agent_restart_is_told_by_its_incarnation(store: EventStore, log: LogBuilder) -> None:
    """The same generation from another process (incarnation): the agent restarted."""
    log.reserve("p", 2)
    log.mint("p", 2)
    log.dispatch("p_g0")
    log.reply("p_g0")
    first = completion_receipt("p_g0", 0).model_copy(update={"execution_incarnation": INC_1})
    log.group("p", [ReceiptFetched(agent_name="agent-a", receipt=first)])
    log.dispatch("p_g1")
    log.fail("p_g1", kind="http")
    again = first.model_copy(update={"execution_incarnation": INC_2})
    log.group("p", [ReceiptFetched(agent_name="agent-a", receipt=again)])
    log.replace("p_g1", 1, reason="agent restarted")
    assert said(store) == []  # nor is p_g0's result stranded: it was lost with the process
