"""What a restore plan reports (trainer.core.recovery.RecoveryPlan.summary) and which debt keys an agent
is owed (trainer.core.retire_debt.owed_keys): the counts `TrainerRestored.plan` records, by name."""

from __future__ import annotations

from projections.ledger import LedgerState, RetireDebt
from protocol.digests import sha256_digest
from protocol.wire import CompletionReceipt, ContinuationRef
from trainer.core.recovery import AttemptToSettle, ClaimToRollBack, RecoveryPlan, SiblingToReplace
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
