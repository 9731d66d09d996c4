"""The auditor: a clean log reports nothing; a log that breaks one rule is reported under that rule."""

from __future__ import annotations

import pytest

from eventstore import EventStore
from eventstore.events import (
    AckAccepted,
    AckOwed,
    AttemptMinted,
    ReceiptFetched,
    ReplacementMinted,
    SiblingHeld,
    SiblingSealed,
)
from projections.audit import (
    BOUNDED_RETRIES,
    CHECKPOINT_CLEAN,
    DEBT_UNTIL_ACCEPTED,
    DEBT_WITH_RESULT,
    EVENT_READABLE,
    GROUP_SEAL_COMPLETE,
    NO_REUSED_TRY,
    NO_STRANDED_RESULT,
    RECEIPT_MATCHES,
    RETIRE_BEFORE_REPLACE,
    ROUND_KEPT_AT_TURN,
    RULES,
    SEAL_BEFORE_ACK,
    TRAINED_ONCE,
    AuditReport,
)
from projections.base import ReplayRefused
from projections.runner import rebuild
from projections.training_audit import TRAINED_ONCE_ACROSS_RESTORES
from tests.projections.audit_fold import audit_both_ways
from tests.projections.builder import LogBuilder, completion_receipt, rollout_receipt
from tests.projections.tamper import append_raw


def audit(store: EventStore) -> AuditReport:
    return audit_both_ways(store)


def only(report: AuditReport, rule: str) -> list[list[int]]:
    """The positions of each violation, after checking that `rule` is the only rule broken."""
    assert {v.rule for v in report.violations} == {rule}, report.as_json()
    return [v.positions for v in report.violations]


def clean_history(log: LogBuilder) -> None:
    """Every path of the protocol once: retries, adoption, masking, abandonment, checkpoints, a restore."""
    log.clean_sibling_group("p1", 2, step=0)
    # p2: a deadline then a cancelled retire and a replacement; a lost reply adopted
    log.reserve("p2", 2)
    log.mint("p2")
    log.dispatch("p2_g0")
    log.dispatch("p2_g1")
    log.fail("p2_g0")
    log.replace("p2_g0", 1, retire="cancelled")
    log.dispatch("p2_g0", 1)
    log.reply("p2_g0", 1)
    log.seal("p2_g0", 1)
    log.ack("p2_g0", 1)
    log.fail("p2_g1")
    log.retire("p2_g1", 0, "completed_unacknowledged")
    log.adopt("p2_g1", 0)
    log.reply("p2_g1", 0)
    log.seal("p2_g1", 0)
    log.ack("p2_g1", 0)
    log.seal_group("p2", {0: 1, 1: 0})
    log.claim("p2", 1)
    # p3: prompt_group, one sibling held and ACKed, the other fails; the group is rerun whole
    log.reserve("p3", 2, mode="prompt_group")
    log.mint("p3")
    log.dispatch("p3_g0")
    log.dispatch("p3_g1")
    log.reply("p3_g0")
    log.hold("p3_g0")
    log.ack("p3_g0")
    log.fail("p3_g1", kind="env")
    log.retire("p3_g1", 0, "tombstoned")
    log.abandon("p3", {0: 0, 1: 0})
    log.replace("p3_g0", 1, reason="group abandoned")
    log.replace("p3_g1", 1, reason="group abandoned")
    for i in range(2):
        log.dispatch(f"p3_g{i}", 1)
        log.reply(f"p3_g{i}", 1)
        log.hold(f"p3_g{i}", 1)
        log.ack(f"p3_g{i}", 1)
    log.seal_group("p3", {0: 1, 1: 1}, held=True)
    log.claim("p3", 2)
    log.logprobs("p3_g0", 1)
    log.checkpoint("c1")
    cut = log.store.head() - 1
    # p4: a masked reply is owed and ACKed before its replacement
    log.reserve("p4", 1)
    log.mint("p4", 1)
    log.dispatch("p4_g0")
    log.reply("p4_g0", mask=True)
    log.owe("p4_g0")
    log.ack("p4_g0")
    log.replace("p4_g0", 1, reason="masked")
    log.dispatch("p4_g0", 1)
    log.reply("p4_g0", 1)
    log.seal("p4_g0", 1)
    log.ack("p4_g0", 1)
    log.seal_group("p4", {0: 1})
    log.claim("p4", 3)
    # a restart rolls back the claim of p4 (after the cut), which is then trained again
    log.restored(cut, "c1", {"debts_to_flush": 0})
    log.claim("p4", 3)
    # p5: the agent restarted and lost a finished result
    log.reserve("p5", 1)
    log.mint("p5", 1)
    log.dispatch("p5_g0")
    log.reply("p5_g0")
    log.owe("p5_g0")
    log.reject("p5_g0", error="unknown_execution")
    # p6: dead-lettered after its budget
    log.reserve("p6", 1, max_tries=2)
    log.mint("p6", 1)
    log.dispatch("p6_g0")
    log.fail("p6_g0")
    log.replace("p6_g0", 1, retire="cancelled")
    log.dispatch("p6_g0", 1)
    log.fail("p6_g0", 1)
    log.retire("p6_g0", 1, "cancelled")
    log.dead_letter("p6", {0: 1})
    log.prepare("c2")
    log.abort("c2")
    log.checkpoint("c3")


def test_clean_log_reports_nothing(store: EventStore, log: LogBuilder) -> None:
    clean_history(log)
    report = audit(store)
    assert report.ok, report.as_json()
    assert report.events == store.head()
    assert report.rules_checked == list(RULES)


def test_no_reused_try(store: EventStore, log: LogBuilder) -> None:
    log.reserve("p", 1)
    first = log.mint("p", 1)
    again = log.group("p", [AttemptMinted(rollout_id="p_g0", generation_index=0)])
    skip = log.group(
        "p",
        [ReplacementMinted(rollout_id="p_g0", generation_index=0, attempt_index=2, replaces=1, reason="x")],
    )
    assert only(audit(store), NO_REUSED_TRY) == [first + again, first + skip]


def test_seal_before_ack(store: EventStore, log: LogBuilder) -> None:
    log.reserve("p", 1)
    log.mint("p", 1)
    log.dispatch("p_g0")
    log.reply("p_g0")
    receipt = completion_receipt("p_g0", 0)
    (fetched,) = log.group("p", [ReceiptFetched(agent_name="agent-a", receipt=receipt)])
    acked = log.ack("p_g0")
    assert only(audit(store), SEAL_BEFORE_ACK) == [[fetched, *acked]]


def test_debt_with_result(store: EventStore, log: LogBuilder) -> None:
    """A seal whose debt is appended later (the next row is not its AckOwed): a crash in between leaves
    a result the log never owes."""
    log.reserve("p", 1)
    log.mint("p", 1)
    log.dispatch("p_g0")
    log.reply("p_g0")
    receipt = completion_receipt("p_g0", 0)
    _, sealed = log.group(
        "p",
        [
            ReceiptFetched(agent_name="agent-a", receipt=receipt),
            SiblingSealed(rollout_id="p_g0", attempt_index=0, reward=1.0, receipt=rollout_receipt("p_g0", 0)),
        ],
    )
    later = log.owe("p_g0")
    assert only(audit(store), DEBT_WITH_RESULT) == [[sealed, later[0]]]


def test_debt_with_result_prompt_group_owed_only_at_the_group_seal(
    store: EventStore, log: LogBuilder
) -> None:
    """The seeds' first bug where its group does seal: a held sibling's debt recorded only with the seal."""
    log.reserve("g", 2, mode="prompt_group")
    log.mint("g")
    log.dispatch("g_g0")
    log.dispatch("g_g1")
    log.reply("g_g0")
    receipt = completion_receipt("g_g0", 0)
    _, held = log.group(
        "g",
        [
            ReceiptFetched(agent_name="agent-a", receipt=receipt),
            SiblingHeld(rollout_id="g_g0", attempt_index=0, receipt=rollout_receipt("g_g0", 0)),
        ],
    )
    replied = log.reply("g_g1")
    log.hold("g_g1")
    log.owe("g_g0")
    log.seal_group("g", {0: 0, 1: 0}, held=True)
    assert only(audit(store), DEBT_WITH_RESULT) == [[held, *replied]]


def test_debt_until_accepted(store: EventStore, log: LogBuilder) -> None:
    log.reserve("p", 1)
    log.mint("p", 1)
    log.dispatch("p_g0")
    log.reply("p_g0")
    owed = log.seal("p_g0")[-1]
    restored = log.restored(None, None, {"debts_to_flush": 0})
    assert only(audit(store), DEBT_UNTIL_ACCEPTED) == [[owed, *restored]]


def test_no_stranded_result(store: EventStore, log: LogBuilder) -> None:
    log.reserve("p", 1)
    log.mint("p", 1)
    log.dispatch("p_g0")
    replied = log.reply("p_g0")
    receipt = completion_receipt("p_g0", 0)
    log.group("p", [ReceiptFetched(agent_name="agent-a", receipt=receipt)])
    dead = log.dead_letter("p", {0: 0})
    assert only(audit(store), NO_STRANDED_RESULT) == [replied + dead]


def test_no_stranded_result_prompt_group_abandoned(store: EventStore, log: LogBuilder) -> None:
    """The seeds' first bug: a held sibling never owed its ACK, thrown away with the group."""
    log.reserve("g", 2, mode="prompt_group")
    log.mint("g")
    log.dispatch("g_g0")
    log.dispatch("g_g1")
    replied = log.reply("g_g0")
    log.fail("g_g1")
    log.retire("g_g1", 0, "cancelled")
    log.retire("g_g0", 0, "done")  # the agent considers it done; the trainer never owed it
    log.abandon("g", {0: 0, 1: 0})
    replaced = log.replace("g_g0", 1)
    log.replace("g_g1", 1)
    assert only(audit(store), NO_STRANDED_RESULT) == [replied + replaced]


def test_retire_before_replace(store: EventStore, log: LogBuilder) -> None:
    log.reserve("p", 1)
    log.mint("p", 1)
    dispatched = log.dispatch("p_g0")
    log.fail("p_g0")
    replaced = log.replace("p_g0", 1)
    assert only(audit(store), RETIRE_BEFORE_REPLACE) == [dispatched + replaced]


def test_replacement_after_completed_unacknowledged(store: EventStore, log: LogBuilder) -> None:
    """The seeds' second bug: a finished try is replaced instead of adopted (also a stranded result)."""
    log.reserve("p", 1)
    log.mint("p", 1)
    log.dispatch("p_g0")
    log.fail("p_g0")
    retired = log.retire("p_g0", 0, "completed_unacknowledged")
    replaced = log.replace("p_g0", 1)
    report = audit(store)
    assert {v.rule for v in report.violations} == {RETIRE_BEFORE_REPLACE, NO_STRANDED_RESULT}
    assert all(v.positions == retired + replaced for v in report.violations)


# Trainer "A": the restart is known by the agent as its trainer knows it (A's agent-a), so a receipt of
# A's from a new process lets A replace a try that was running there with no retire answer.
@pytest.mark.parametrize("trainer", [None, "A"])
def test_agent_restart_allows_replacement(store: EventStore, log: LogBuilder, trainer: str | None) -> None:
    log.reserve("p", 2, trainer=trainer)
    log.mint("p", 2)
    log.dispatch("p_g0")
    log.reply("p_g0")
    log.seal("p_g0")
    log.ack("p_g0")
    log.dispatch("p_g1")
    log.fail("p_g1", kind="http")
    # the agent came back with a new execution generation: the running try died with it
    log.group(
        "p", [ReceiptFetched(agent_name="agent-a", receipt=completion_receipt("p_g0", 0, generation=2))]
    )
    log.replace("p_g1", 1, reason="agent restarted")
    assert audit(store).ok


def test_another_trainers_agent_of_the_same_name_restarting_is_not_this_ones_restart(
    store: EventStore, log: LogBuilder
) -> None:
    """Trainers A and B each drive their own agent called agent-a: a receipt of B's from another agent
    process says nothing of A's, so A's replacement with no retire answer still violates the rule."""
    log.reserve("p", 2, trainer="A")
    log.mint("p", 2)
    log.dispatch("p_g0")
    log.reply("p_g0")
    log.seal("p_g0")
    log.ack("p_g0")
    dispatched = log.dispatch("p_g1")
    log.fail("p_g1", kind="http")
    log.reserve("q", 1, trainer="B")
    log.mint("q", 1)
    log.dispatch("q_g0")
    log.reply("q_g0")
    log.group(
        "q", [ReceiptFetched(agent_name="agent-a", receipt=completion_receipt("q_g0", 0, generation=2))]
    )
    replaced = log.replace("p_g1", 1, reason="agent restarted")
    assert only(audit(store), RETIRE_BEFORE_REPLACE) == [dispatched + replaced]


def test_receipt_matches(store: EventStore, log: LogBuilder) -> None:
    log.reserve("p", 2)
    log.mint("p", 2)
    log.dispatch("p_g0")
    replied = log.reply("p_g0")
    wrong = completion_receipt("p_g0", 0, digest="sha256:" + "1" * 64)
    owed = log.group(
        "p",
        [ReceiptFetched(agent_name="agent-a", receipt=wrong), AckOwed(agent_name="agent-a", receipt=wrong)],
    )[-1]
    log.ack("p_g0")
    log.dispatch("p_g1")
    log.reply("p_g1")
    fetched = log.group("p", [ReceiptFetched(agent_name="agent-a", receipt=completion_receipt("p_g1", 0))])
    other = completion_receipt("p_g1", 0, generation=1).model_copy(update={"result_identity": "other"})
    owed_other = log.group("p", [AckOwed(agent_name="agent-a", receipt=other)])
    assert only(audit(store), RECEIPT_MATCHES) == [[*replied, owed], fetched + owed_other]


def test_group_seal_complete(store: EventStore, log: LogBuilder) -> None:
    log.reserve("p", 2)
    log.mint("p", 2)
    for i in range(2):
        log.dispatch(f"p_g{i}")
    log.reply("p_g0")
    log.seal("p_g0")
    log.ack("p_g0")
    sealed = log.seal_group("p", {0: 0})
    twice = log.seal_group("p", {0: 0})
    assert only(audit(store), GROUP_SEAL_COMPLETE) == [sealed, sealed + twice]


def test_checkpoint_clean(store: EventStore, log: LogBuilder) -> None:
    log.reserve("p", 1)
    log.mint("p", 1)
    log.dispatch("p_g0")
    log.reply("p_g0")
    owed = log.seal("p_g0")[-1]
    log.prepare("c1")
    committed = log.commit("c1")
    log.ack("p_g0")  # paid, but only after the cut
    assert only(audit(store), CHECKPOINT_CLEAN) == [[owed, *committed]]


def test_a_checkpoint_may_carry_a_finished_try_unpaid_at_its_cut(store: EventStore, log: LogBuilder) -> None:
    """A debt the commit names as carried is allowed unpaid at the cut; another one still is not."""
    log.reserve("p", 2)
    log.mint("p", 2)
    for i in range(2):
        log.dispatch(f"p_g{i}")
        log.reply(f"p_g{i}")
    log.seal("p_g0")
    log.seal("p_g1")
    log.prepare("c1")
    log.commit("c1", carried=[("p_g0", 0), ("p_g1", 0)])
    log.ack("p_g0")
    log.ack("p_g1")
    assert audit(store).ok
    log.reserve("q", 2)
    log.mint("q", 2)
    for i in range(2):
        log.dispatch(f"q_g{i}")
        log.reply(f"q_g{i}")
    log.seal("q_g0")
    owed = log.seal("q_g1")[-1]
    log.prepare("c2")
    committed = log.commit("c2", carried=[("q_g0", 0)])
    log.ack("q_g0")
    log.ack("q_g1")
    assert only(audit(store), CHECKPOINT_CLEAN) == [[owed, *committed]]


def test_checkpoint_of_other_agents_is_clean(store: EventStore, log: LogBuilder) -> None:
    log.reserve("p", 1)
    log.mint("p", 1)
    log.dispatch("p_g0")
    log.reply("p_g0")
    log.seal("p_g0")
    log.prepare("c1", ["agent-b"])
    log.commit("c1", participants=["agent-b"])
    assert audit(store).ok


def test_trained_once(store: EventStore, log: LogBuilder) -> None:
    log.clean_sibling_group("p", 1)
    first = log.claim("p", 1)
    log.checkpoint("c1")
    log.restored(store.head(), "c1", {"debts_to_flush": 0})  # the cut keeps the first claim
    second = log.claim("p", 2)
    assert only(audit(store), TRAINED_ONCE) == [first + second]


def test_trained_once_across_restores(store: EventStore, log: LogBuilder) -> None:
    """Steps 3 and 4 saved; a restore to step 3 rolls step 4's claim back and the rerun step 4 claims
    the group again (legal: the restored state never trained it).  A later restore to the first step 4,
    on the branch that restore abandoned, brings back a state that trained the group while the log
    holds no claim of it: claiming it again is training it twice, which only this rule sees (the log's
    own claims say it is free)."""
    log.clean_sibling_group("p", 1)

    def checkpoint(checkpoint_id: str) -> int:
        log.prepare(checkpoint_id)
        cut = store.head()
        log.commit(checkpoint_id, cut=cut)
        log.resume(checkpoint_id)
        return cut

    step_3 = checkpoint("step_3")
    [first] = log.claim("p", 4)
    step_4 = checkpoint("step_4")
    log.restored(step_3, "step_3", {"debts_to_flush": 0})
    log.claim("p", 4)
    checkpoint("step_4.r1")
    [back] = log.restored(step_4, "step_4", {"debts_to_flush": 0})
    [again] = log.claim("p", 5)
    report = audit(store)
    assert only(report, TRAINED_ONCE_ACROSS_RESTORES) == [[first, back, again]]
    # The whole message: the step of the claim made again and the checkpoint the restore brought back.
    assert [v.message for v in report.violations] == [
        f"group p is claimed for training again (step 5) though the state its trainer holds trained on it "
        f"at {first}, brought back by its restore at {back} to checkpoint step_4 (a state on a branch an "
        "earlier restore had left): the log let go of that claim, the trainer's state did not"
    ]


def test_bounded_retries(store: EventStore, log: LogBuilder) -> None:
    log.reserve("p", 1, max_tries=1)
    log.mint("p", 1)
    log.dispatch("p_g0")
    log.fail("p_g0")
    replaced = log.replace("p_g0", 1, retire="cancelled")[-1]
    log.dispatch("p_g0", 1)
    log.fail("p_g0", 1)
    log.retire("p_g0", 1, "cancelled")
    dead = log.dead_letter("p", {0: 1})
    after = log.replace("p_g0", 2)
    assert only(audit(store), BOUNDED_RETRIES) == [[replaced], dead + after]


def test_a_refused_request_is_never_retried(store: EventStore, log: LogBuilder) -> None:
    """A try whose request the agent refused itself (413, 422) ends its group: a replacement is the
    same request sent again."""
    log.reserve("p", 1)
    log.mint("p", 1)
    log.dispatch("p_g0")
    refused = log.fail("p_g0", kind="refused")
    log.retire("p_g0", 0, "tombstoned")
    again = log.replace("p_g0", 1)
    assert only(audit(store), BOUNDED_RETRIES) == [refused + again]


@pytest.mark.parametrize(
    ("type_", "version", "data", "why"),
    [
        ("GroupRenamed", 1, '{"group_id": "p"}', "unknown event type"),
        (
            "AckAccepted",
            9,
            '{"rollout_id": "p_g0", "attempt_index": 0, "idempotent": false}',
            "schema version 9",
        ),
        (
            "AckAccepted",
            1,
            '{"rollout_id": "p_g0", "attempt_index": "zero", "idempotent": false}',
            "validate",
        ),
        ("AckAccepted", 1, '{"rollout_id": "p_g0", "attempt_index": 0, "idempotent": fals', "JSON"),
    ],
)
def test_unreadable_event_is_reported_and_the_audit_carries_on(
    store: EventStore, log: LogBuilder, db_url: str, type_: str, version: int, data: str, why: str
) -> None:
    log.clean_sibling_group("p", 1)
    bad = append_raw(store, db_url, "group-p", type_, version, data)
    twice = log.claim("p", 1) + log.claim("p", 2)  # found although it comes after the unreadable row
    report = audit(store)
    readable = [v for v in report.violations if v.rule == EVENT_READABLE]
    assert [v.positions for v in readable] == [[bad]] and why in readable[0].message
    assert [v.positions for v in report.violations if v.rule == TRAINED_ONCE] == [twice]
    assert {v.rule for v in report.violations} == {EVENT_READABLE, TRAINED_ONCE}

    with pytest.raises(ReplayRefused) as refused:
        rebuild(store, from_checkpoint=False)
    assert refused.value.position == bad and why in refused.value.reason
    assert rebuild(store, to_position=bad - 1, from_checkpoint=False).position == bad - 1


def test_ack_in_another_stream_is_followed(store: EventStore, log: LogBuilder) -> None:
    log.reserve("p", 1)
    log.mint("p", 1)
    log.dispatch("p_g0")
    log.reply("p_g0")
    log.seal("p_g0")
    log.append("acks-agent-a", [AckAccepted(rollout_id="p_g0", attempt_index=0, idempotent=False)])
    log.seal_group("p", {0: 0})
    log.prepare("c1")
    log.commit("c1")
    assert audit(store).ok


def test_a_result_lost_with_its_agent_is_not_stranded(store: EventStore, log: LogBuilder) -> None:
    """The agent restarted after replying: retire answers tombstoned (never seen); replacing is right."""
    log.reserve("r", 1)
    log.mint("r", 1)
    log.dispatch("r_g0")
    log.reply("r_g0")
    log.fail("r_g0", kind="receipt")
    log.retire("r_g0", 0, "tombstoned")
    log.replace("r_g0", 1)
    assert audit(store).ok


@pytest.mark.parametrize(("answered_done", "stranded"), [(8, False), (7, True), (None, True)])
def test_a_result_lost_with_the_process_that_held_it_is_not_stranded(
    store: EventStore, log: LogBuilder, answered_done: int | None, stranded: bool
) -> None:
    """Generation 7 held the finished result (`completed_unacknowledged`); generation 8, started since,
    answers `done` (its own tombstone, its `tombstoned` answer lost): the result went with generation 7.
    `done` from the same generation, or from an unrecorded one, is no such evidence."""
    log.reserve("r", 1)
    log.mint("r", 1)
    log.dispatch("r_g0")
    log.fail("r_g0", kind="receipt")
    finished = log.retire("r_g0", 0, "completed_unacknowledged", generation=7)
    log.retire("r_g0", 0, "done", generation=answered_done)
    replaced = log.replace("r_g0", 1)
    if stranded:
        assert only(audit(store), NO_STRANDED_RESULT) == [finished + replaced]
    else:
        assert audit(store).ok


def test_round_kept_at_turn(store: EventStore, log: LogBuilder) -> None:
    """A prompt group at level turn reruns its round only for a failure of its own: an interruption
    (here a retire with no failure recorded) does not abandon it; a sibling's environment failure does."""
    log.reserve("t", 2, mode="prompt_group", target_level="turn")
    log.mint("t")
    log.dispatch("t_g0")
    log.dispatch("t_g1")
    log.reply("t_g0")
    log.hold("t_g0")
    log.retire("t_g1", 0, "cancelled")  # interrupted: a trainer restart, say
    abandoned = log.abandon("t", {0: 0, 1: 0})
    assert only(audit(store), ROUND_KEPT_AT_TURN) == [abandoned]
    log.reserve("u", 2, mode="prompt_group", target_level="turn")
    log.mint("u")
    log.dispatch("u_g0")
    log.dispatch("u_g1")
    log.fail("u_g1", kind="env")  # the group's own failure: rerunning the round is right
    log.retire("u_g1", 0, "cancelled")
    log.abandon("u", {0: 0, 1: 0})
    assert only(audit(store), ROUND_KEPT_AT_TURN) == [abandoned]
