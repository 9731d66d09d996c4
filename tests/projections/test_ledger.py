"""The ledger fold and the recovery plan derived from it."""

from __future__ import annotations

import pytest

from eventstore import EventStore
from projections.audit import audit_log
from projections.base import fold
from projections.checkpoints import CheckpointsProjection, CheckpointsState
from projections.ledger import LedgerProjection, LedgerState, restorable_cut
from projections.recovery import (
    RECOVERY_SCHEMA_VERSION,
    RestoreRefused,
    RolloutRecoveryState,
)
from tests.projections.builder import LogBuilder
from trainer.core.recovery import plan_recovery


def ledger_of(store: EventStore) -> LedgerState:
    return fold(LedgerProjection(), store.read_all())


def checkpoints_of(store: EventStore) -> CheckpointsState:
    return fold(CheckpointsProjection(), store.read_all())


def test_sibling_group_lifecycle(store: EventStore, log: LogBuilder) -> None:
    log.reserve("p1", 2)
    log.mint("p1")
    log.dispatch("p1_g0")
    log.dispatch("p1_g1")
    log.reply("p1_g0", reward=0.5)
    log.seal("p1_g0", reward=0.5)
    state = ledger_of(store)
    group = state.groups["p1"]
    assert group.status == "open" and group.mode == "sibling" and group.attempts_used == 1
    assert group.stream_version == store.stream_version("group-p1")
    s0, s1 = group.siblings[0], group.siblings[1]
    assert (s0.status, s0.sealed_attempt, s0.reward) == ("sealed", 0, 0.5)
    assert s0.attempts[0].status == "sealed" and s0.attempts[0].receipt is not None
    assert s1.attempts[0].status == "dispatched" and s1.attempts[0].capture_key == "p1_g1"
    assert [r.rollout_id for _, r in state.unpaid_debts()] == ["p1_g0"]
    assert state.unpaid_debts("other") == []

    log.ack("p1_g0")
    log.fail("p1_g1")
    log.replace("p1_g1", 1, retire="cancelled")
    log.dispatch("p1_g1", 1)
    log.reply("p1_g1", 1)
    log.seal("p1_g1", 1)
    log.ack("p1_g1", 1)
    log.seal_group("p1", {0: 0, 1: 1})
    log.claim("p1", 3)
    state = ledger_of(store)
    group = state.groups["p1"]
    assert group.status == "sealed" and group.attempts_used == 2 and group.claimed_steps == [3]
    assert group.siblings[1].attempts[0].status == "retired"
    assert group.siblings[1].attempts[0].failures == ["deadline: deadline passed"]
    assert group.siblings[1].current_attempt == 1 and group.siblings[1].sealed_attempt == 1
    assert state.unpaid_debts() == []
    assert state.position == store.head()


def test_prompt_group_abandon_and_rerun(store: EventStore, log: LogBuilder) -> None:
    log.reserve("g", 2, mode="prompt_group")
    log.mint("g")
    log.dispatch("g_g0")
    log.dispatch("g_g1")
    log.reply("g_g0")
    log.hold("g_g0")
    log.fail("g_g1", kind="env")
    log.retire("g_g1", 0, "tombstoned")
    log.abandon("g", {0: 0, 1: 0})
    state = ledger_of(store)
    group = state.groups["g"]
    assert group.abandoned_rounds == 1 and group.siblings[0].status == "pending"
    assert group.siblings[0].attempts[0].status == "discarded"
    assert group.siblings[1].attempts[0].status == "retired"
    # The held sibling's debt stays until it is ACKed, abandoned or not.
    assert [r.rollout_id for _, r in state.unpaid_debts()] == ["g_g0"]
    log.replace("g_g0", 1)
    log.replace("g_g1", 1)
    assert ledger_of(store).groups["g"].attempts_used == 2


def test_rejections(store: EventStore, log: LogBuilder) -> None:
    log.clean_sibling_group("p", 2)
    log.reserve("q", 2)
    log.mint("q")
    for i in range(2):
        log.dispatch(f"q_g{i}")
        log.reply(f"q_g{i}")
        log.seal(f"q_g{i}")
    log.reject("q_g0", error="unknown_execution")
    log.reject("q_g1", error="receipt_mismatch")
    assert [r.rollout_id for _, r in ledger_of(store).unpaid_debts()] == ["q_g1"]


def test_dump_load_round_trip(store: EventStore, log: LogBuilder) -> None:
    log.clean_sibling_group("p", 3, step=1)
    log.reserve("q", 2, mode="prompt_group")
    log.mint("q")
    log.dispatch("q_g0")
    log.reply("q_g0")
    log.hold("q_g0")
    projection = LedgerProjection()
    state = ledger_of(store)
    again = projection.loads(projection.dumps(state))
    assert again == state
    assert projection.state_hash(again) == projection.state_hash(state)
    assert projection.load(projection.dump(state)) == state


def test_archive_after_committed_cut(store: EventStore, log: LogBuilder) -> None:
    """A group done before a cut is archived by the next commit: a trainer may come back on the
    checkpoint before its newest, and a restore to it must still find the groups claimed since."""
    log.clean_sibling_group("p", 2, step=1)
    log.clean_sibling_group("q", 2)  # sealed, never claimed: stays in play
    log.checkpoint("c1")
    assert "p" in ledger_of(store).groups
    log.clean_sibling_group("r", 1, step=2)
    log.checkpoint("c2")
    state = ledger_of(store)
    assert "p" in state.archived and "p" not in state.groups and state.knows_group("p")
    assert "q" in state.groups and "r" in state.groups
    assert state.archived["p"].claimed_steps == [1]
    assert not restorable_cut(state, None, 0) and restorable_cut(state, None, state.cuts[""])


def test_recovery_state_and_plan(store: EventStore, log: LogBuilder) -> None:
    log.clean_sibling_group("done", 1, step=0)
    log.checkpoint("c1")
    cut = checkpoints_of(store).checkpoints["c1"].cut_position
    log.clean_sibling_group("late", 1, step=1)  # claimed after the cut: rolled back
    log.reserve("s", 4)
    log.mint("s", 4)
    log.dispatch("s_g0")  # in flight
    log.dispatch("s_g1")
    log.reply("s_g1")  # replied, never sealed: adopt
    log.dispatch("s_g2")
    log.fail("s_g2")
    log.retire("s_g2", 0, "cancelled")  # settled without a result: replace
    log.dispatch("s_g3")
    log.reply("s_g3")
    log.seal("s_g3")  # sealed, debt unpaid: flush
    log.reserve("pg", 2, mode="prompt_group")
    log.mint("pg")
    log.dispatch("pg_g0")
    log.prepare("c2")  # never decided: presumed abort
    ledger, checkpoints = ledger_of(store), checkpoints_of(store)

    snapshot = RolloutRecoveryState.of(ledger, checkpoints)
    data = snapshot.model_dump(mode="json")
    assert data["schema_version"] == RECOVERY_SCHEMA_VERSION
    assert [a["receipt"]["rollout_id"] for a in data["pending_acks"]] == ["s_g3"]
    assert RolloutRecoveryState.model_validate(data).state_hash() == snapshot.state_hash()

    plan = plan_recovery(ledger, checkpoints)
    assert [r.rollout_id for r in plan.debts_to_flush["agent-a"]] == ["s_g3"]
    actions = {(t.rollout_id, t.action) for t in plan.attempts_to_settle}
    # The prompt-group round was interrupted between its dispatches: what left is settled, the
    # unsent try is not sent, and the round is rerun whole (as its driver does).
    assert actions == {("s_g0", "retire_or_adopt"), ("s_g1", "adopt"), ("pg_g0", "retire_or_adopt")}
    assert [(s.rollout_id, s.next_attempt) for s in plan.siblings_to_replace] == [("s_g2", 1)]
    assert plan.groups_to_rerun == ["pg"]
    assert plan.checkpoints_to_abort == ["c2"] and plan.checkpoints_to_resume == []
    assert plan.cut_position == cut and plan.checkpoint_id == "c1"
    assert [c.group_id for c in plan.claims_to_roll_back] == ["late"]
    assert plan.summary()["claims_to_roll_back"] == 1
    assert "late" in plan.sealed_kept

    log.restored(plan.cut_position, plan.checkpoint_id, plan.summary())
    assert ledger_of(store).groups["late"].claims == []


def test_a_restore_to_the_checkpoint_the_trainer_loaded(store: EventStore, log: LogBuilder) -> None:
    """The trainer came back on c1 though c2 committed after it (it died before its own save of c2
    was final): the claims after c1's cut roll back, none of their groups archived; a checkpoint the
    log cannot restore to is refused in one line; a restart that kept the trainer's state keeps
    every claim."""
    log.clean_sibling_group("a", 1, step=0)
    log.checkpoint("c1")
    log.clean_sibling_group("b", 1, step=1)
    log.checkpoint("c2")
    log.clean_sibling_group("c", 1, step=2)
    log.prepare("c3")
    log.abort("c3")
    ledger, checkpoints = ledger_of(store), checkpoints_of(store)

    newest = plan_recovery(ledger, checkpoints)
    assert newest.checkpoint_id == "c2" and [c.group_id for c in newest.claims_to_roll_back] == ["c"]
    back = plan_recovery(ledger, checkpoints, restore_to="c1")
    assert back.checkpoint_id == "c1" and back.cut_position == checkpoints.checkpoints["c1"].cut_position
    assert [c.group_id for c in back.claims_to_roll_back] == ["b", "c"]
    assert {"b", "c"} <= set(back.sealed_kept)
    kept = plan_recovery(ledger, checkpoints, claims_kept=True)
    assert kept.claims_to_roll_back == [] and kept.claims_kept and kept.summary()["claims_to_roll_back"] == 0
    assert (kept.cut_position, kept.checkpoint_id) == (None, None)  # no restore point: it stands where it is
    assert [(c.group_id, c.train_step) for c in back.claims_to_roll_back] == [("b", 1), ("c", 2)]

    for name, says in (
        ("nope", "'nope' is not in the log"),
        ("c3", "'c3' is aborted in the log, not committed"),
    ):
        with pytest.raises(RestoreRefused, match=says):
            plan_recovery(ledger, checkpoints, restore_to=name)
    with pytest.raises(RestoreRefused, match="belongs to trainer None"):
        plan_recovery(ledger, checkpoints, "T9", restore_to="c1")

    log.restored(back.cut_position, back.checkpoint_id, back.summary())
    restored = ledger_of(store)
    assert restored.groups["b"].claims == [] and restored.groups["c"].claims == []
    assert restored.archived["a"].claims  # before c1's cut: stands (archived by c2's commit)
    log.claim("b", 1)
    log.checkpoint("c4")  # would archive up to c1's cut, the one the trainer stood at: done already
    log.checkpoint("c5")  # up to c4's
    state = ledger_of(store)
    assert "a" in state.archived and "b" in state.archived and "c" in state.groups
    with pytest.raises(RestoreRefused, match="older than the log can restore"):
        plan_recovery(state, checkpoints_of(store), restore_to="c1")
    assert plan_recovery(state, checkpoints_of(store), restore_to="c4").checkpoint_id == "c4"
    assert audit_log(store).ok, audit_log(store).as_json()["violations"]


def test_the_plan_names_the_boundary_each_replacement_resumes(store: EventStore, log: LogBuilder) -> None:
    """A try retired with an offer before the trainer went down: at target level turn its replacement
    resumes it (the drivers' own rule), and the plan's summary counts it and the turns it keeps; at
    sibling the same history replaces it from its prompt."""
    from eventstore.events import AttemptRetired, GroupReserved, PromptRef
    from tests.projections.test_turn_audit import offer

    for group_id, level in (("t1", "turn"), ("s1", "sibling")):
        reserved = GroupReserved(
            group_id=group_id, prompt_ref=PromptRef(sample_id=group_id, task_name="math"), agent_name=log.agent,
            expected_generations=1, mode="sibling", target_level=level, requested_level=level,
        )  # fmt: skip
        log.group(group_id, [reserved])
        log.mint(group_id, 1)
        log.dispatch(f"{group_id}_g0")
        offered = offer(0, 3).model_copy(update={"rollout_id": f"{group_id}_g0"})
        retired = AttemptRetired(
            rollout_id=f"{group_id}_g0", attempt_index=0, outcome="cancelled", continuation=offered
        )
        log.group(group_id, [retired])
    plan = plan_recovery(ledger_of(store), checkpoints_of(store))
    replace = {s.rollout_id: s for s in plan.siblings_to_replace}
    assert replace["t1_g0"].continues is not None and replace["t1_g0"].continues.turn == 3
    assert replace["s1_g0"].continues is None
    assert plan.summary()["replacements_resuming"] == 1 and plan.summary()["turns_kept"] == 3
