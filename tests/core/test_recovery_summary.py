"""What a restore plan holds and reports (trainer.core.recovery), over ledgers built by hand, and which
debt keys an agent is owed (trainer.core.retire_debt.owed_keys)."""

from __future__ import annotations

from projections.checkpoints import CheckpointsState, CheckpointState
from projections.ledger import ClaimState, GroupState, LedgerState, RetireDebt
from protocol.digests import sha256_digest
from protocol.ids import rollout_id_of
from protocol.wire import CompletionReceipt, ContinuationRef
from tests.core.test_group_core import attempt, group
from tests.core.test_group_moves import interrupted_at
from trainer.core.recovery import (
    AttemptToSettle,
    ClaimToRollBack,
    RecoveryPlan,
    SiblingToReplace,
    plan_recovery,
)
from trainer.core.retire_debt import owed_keys


def receipt(rid: str) -> CompletionReceipt:
    return CompletionReceipt(
        rollout_id=rid,
        attempt_index=0,
        execution_generation=1,
        execution_incarnation="a" * 32,
        result_identity="r",
        result_digest=sha256_digest(rid.encode()),
        manifest_capture_key=rid,
        terminal_model_call_id="m1",
    )


def offer(rid: str, turn: int) -> ContinuationRef:
    return ContinuationRef(
        rollout_id=rid,
        source_attempt=0,
        lineage=f"{rid}-l",
        turn=turn,
        digest=sha256_digest(b"c"),
        prompt_digest=sha256_digest(b"p"),
        model_call_ids=["m1"],
        generated_tokens=5,
    )


def test_the_summary_counts_each_part_of_the_plan_under_its_own_name() -> None:
    def sibling(rid: str, continues: ContinuationRef | None) -> SiblingToReplace:
        return SiblingToReplace(
            group_id="g", rollout_id=rid, generation_index=0, replaces=0, next_attempt=1, continues=continues
        )

    settle = AttemptToSettle(
        group_id="g",
        rollout_id="g_g0",
        generation_index=0,
        attempt_index=0,
        agent_name="agent-a",
        capture_key=None,
        status="dispatched",
        action="retire_or_adopt",
    )
    plan = RecoveryPlan(
        position=41,
        debts_to_flush={"agent-a": [receipt("a_g0"), receipt("a_g1")], "agent-b": [receipt("b_g0")]},
        attempts_to_settle=[settle] * 4,
        siblings_to_replace=[
            sibling("g_g1", offer("g_g1", 3)),
            sibling("g_g2", None),
            sibling("g_g3", offer("g_g3", 2)),
        ],
        groups_to_rerun=["r1", "r2", "r3", "r4", "r5"],
        groups_to_dead_letter=["d1", "d2", "d3", "d4", "d5", "d6"],
        sealed_kept=["s"] * 7,
        checkpoints_to_abort=["c"] * 8,
        checkpoints_to_resume=["c"] * 9,
        claims_to_roll_back=[ClaimToRollBack(group_id="x", train_step=1, position=p) for p in range(10)],
        cut_position=None,
        checkpoint_id=None,
    )
    assert plan.summary() == {
        "as_of_position": 41,
        "debts_to_flush": 3,
        "attempts_to_settle": 4,
        "siblings_to_replace": 3,
        "replacements_resuming": 2,
        "turns_kept": 5,
        "groups_to_rerun": 5,
        "groups_to_dead_letter": 6,
        "sealed_kept": 7,
        "checkpoints_to_abort": 8,
        "checkpoints_to_resume": 9,
        "claims_to_roll_back": 10,
    }


def test_the_keys_owed_to_an_agent_are_its_ack_debts_and_its_retires_owed() -> None:
    debt = RetireDebt(rollout_id="r", attempt_index=0, position=3)
    ledger = LedgerState(
        debts={"agent-a": {"a/0": receipt("a_g0")}, "agent-b": {"b/0": receipt("b_g0")}},
        retires={"agent-a": {"r/0": debt}, "agent-c": {"c/1": debt}},
    )
    assert owed_keys(ledger, "agent-a") == frozenset({"a/0", "r/0"})
    assert owed_keys(ledger, "agent-b") == frozenset({"b/0"})
    assert owed_keys(ledger, "agent-c") == frozenset({"c/1"})
    assert owed_keys(ledger, "agent-z") == frozenset()


# --- the plan of open groups (plan_recovery over a ledger built by hand) -------------------------------


def plan_of(*groups: GroupState) -> RecoveryPlan:
    ledger = LedgerState(groups={g.group_id: g for g in groups})
    return plan_recovery(ledger, CheckpointsState(), claims_kept=True)


def named(g: GroupState, group_id: str, trainer_id: str | None = None) -> GroupState:
    g.group_id, g.trainer_id = group_id, trainer_id
    for s in g.siblings.values():
        s.rollout_id = rollout_id_of(group_id, s.generation_index)
        for a in s.attempts.values():
            a.rollout_id = s.rollout_id
    return g


def test_a_sibling_group_replaces_its_never_minted_siblings_and_its_interrupted_ones() -> None:
    g = named(group("sibling", {0: [interrupted_at(0, 0)]}), "s")
    g.expected_generations = 3
    plan = plan_of(g)
    assert [s.model_dump(exclude={"continues"}) for s in plan.siblings_to_replace] == [
        {"group_id": "s", "rollout_id": "s_g1", "generation_index": 1, "replaces": None, "next_attempt": 0},
        {"group_id": "s", "rollout_id": "s_g2", "generation_index": 2, "replaces": None, "next_attempt": 0},
        {"group_id": "s", "rollout_id": "s_g0", "generation_index": 0, "replaces": 0, "next_attempt": 1},
    ]
    assert plan.groups_to_dead_letter == [] and plan.groups_to_rerun == []


def test_only_a_group_whose_sibling_spent_its_budget_is_dead_lettered() -> None:
    spent = named(
        group("sibling", {0: [interrupted_at(0, 0)], 1: [attempt(1, 0, "dispatched")]}, max_tries=1), "d"
    )
    fine = named(group("sibling", {0: [attempt(0, 0, "dispatched")]}), "f")
    plan = plan_of(spent, fine)
    assert plan.groups_to_dead_letter == ["d"]
    assert {(t.rollout_id, t.action) for t in plan.attempts_to_settle} == {
        ("d_g1", "retire_or_adopt"),
        ("f_g0", "retire_or_adopt"),
    }


def test_every_open_group_of_this_trainer_is_planned_past_the_others() -> None:
    other = named(group("sibling", {0: [attempt(0, 0, "dispatched")]}), "o", trainer_id="T2")
    sealed = named(group("sibling", {0: [attempt(0, 0, "sealed")]}), "z")
    sealed.status = "sealed"
    dead = named(group("sibling", {0: [attempt(0, 0, "failed")]}), "x")
    dead.status = "dead_lettered"
    mine = named(group("sibling", {0: [attempt(0, 0, "dispatched")]}), "m")
    mine.siblings[0].attempts[0].agent_name = "agent-b"
    mine.siblings[0].attempts[0].capture_key = "m_g0-k"
    plan = plan_of(other, sealed, dead, mine)
    assert plan.sealed_kept == ["z"]
    assert plan.attempts_to_settle == [
        AttemptToSettle(
            group_id="m",
            rollout_id="m_g0",
            generation_index=0,
            attempt_index=0,
            agent_name="agent-b",
            capture_key="m_g0-k",
            status="dispatched",
            action="retire_or_adopt",
        )
    ]
    assert (
        plan_of(named(group("sibling", {0: [attempt(0, 0, "dispatched")]}), "n"))
        .attempts_to_settle[0]
        .agent_name
        == "a"
    )


def test_a_prompt_group_given_up_is_rerun_or_dead_lettered_and_never_sends_what_never_left() -> None:
    """A round given up settles what left the trainer (never dispatching the rest), then is rerun whole,
    or dead-lettered once its rounds spent the budget; at level turn an interrupted sibling is replaced."""

    def round_of(group_id: str, **budgets: int) -> GroupState:
        return named(
            group(
                "prompt_group",
                {0: [interrupted_at(0, 0)], 1: [attempt(1, 0, "minted")], 2: [attempt(2, 0, "dispatched")]},
                **budgets,
            ),
            group_id,
        )

    plan = plan_of(round_of("r"), round_of("d", max_tries=1))
    assert plan.groups_to_rerun == ["r"] and plan.groups_to_dead_letter == ["d"]
    assert [(t.rollout_id, t.action) for t in plan.attempts_to_settle] == [
        ("r_g2", "retire_or_adopt"),
        ("d_g2", "retire_or_adopt"),
    ]
    turn = round_of("t")
    turn.target_level = "turn"
    replaced = plan_of(turn).siblings_to_replace
    assert [(s.rollout_id, s.replaces, s.next_attempt) for s in replaced] == [("t_g0", 0, 1)]


def test_the_plan_restores_this_trainers_newest_cut_and_rolls_back_only_the_claims_after_it() -> None:
    """A claim at the cut's own position is inside the checkpoint and stands; the checkpoints to finish or
    presume aborted are this trainer's alone."""
    claimed = named(group("sibling", {0: [attempt(0, 0, "sealed")]}), "a")
    claimed.status = "sealed"
    claimed.claims = [ClaimState(train_step=1, position=50), ClaimState(train_step=2, position=51)]
    checkpoints = CheckpointsState(
        checkpoints={
            "mine": CheckpointState(checkpoint_id="mine", status="committed", cut_position=50),
            "theirs": CheckpointState(
                checkpoint_id="theirs", status="committed", trainer_id="T2", cut_position=49
            ),
            "doubt": CheckpointState(checkpoint_id="doubt"),
            "their-doubt": CheckpointState(checkpoint_id="their-doubt", trainer_id="T2"),
        }
    )
    plan = plan_recovery(LedgerState(groups={"a": claimed}), checkpoints)
    assert (plan.checkpoint_id, plan.cut_position) == ("mine", 50)
    assert plan.claims_to_roll_back == [ClaimToRollBack(group_id="a", train_step=2, position=51)]
    assert (plan.checkpoints_to_resume, plan.checkpoints_to_abort) == (["mine"], ["doubt"])
