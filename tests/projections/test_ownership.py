"""Ownership on a shared log: whose try and debt is whose, by the one rule (projections.ownership)."""

from __future__ import annotations

from eventstore import EventStore
from projections.audit import CHECKPOINT_CLEAN, DEBT_UNTIL_ACCEPTED
from projections.base import fold
from projections.ledger import LedgerProjection, LedgerState
from projections.ownership import AgentRef, Driver, owner_of_try, trainer_debts
from tests.projections.audit_fold import audit_both_ways
from tests.projections.builder import LogBuilder
from tests.projections.test_ledger import checkpoints_of
from trainer.core.recovery import plan_recovery


def ledger_of(store: EventStore) -> LedgerState:
    return fold(LedgerProjection(), store.read_all())


def two_trainers_one_agent_name(log: LogBuilder) -> None:
    """Trainers A and B each drive an agent called `agent-a`; each owes one ACK to its own."""
    for group, trainer in (("pa", "A"), ("pb", "B")):
        log.reserve(group, 1, trainer=trainer)
        log.mint(group, 1)
        log.dispatch(f"{group}_g0")
        log.reply(f"{group}_g0")
        log.seal(f"{group}_g0")


def test_a_debt_is_owed_by_its_groups_trainer_to_that_trainers_agent(
    store: EventStore, log: LogBuilder
) -> None:
    two_trainers_one_agent_name(log)
    ledger = ledger_of(store)
    assert len(ledger.debts["agent-a"]) == 2  # one agent name, two agents
    assert owner_of_try(ledger, "pa_g0") == AgentRef("A", "agent-a")
    assert owner_of_try(ledger, "pb_g0") == AgentRef("B", "agent-a")
    assert owner_of_try(ledger, "nowhere_g0") is None
    a, b = Driver.of("A", ["agent-a"]), Driver.of("B", ["agent-a"])
    assert [k for k, _ in a.debts(ledger, "agent-a")] == ["pa_g0/0"]
    assert [k for k, _ in b.debts(ledger, "agent-a")] == ["pb_g0/0"]
    assert Driver.of("A", ["agent-x"]).debts(ledger, "agent-a") == []  # not an agent it drives
    assert a.unpaid(ledger, ["agent-a"]) == {"agent-a": 1}
    assert a.refusal(ledger, "pa_g0", "retire") is None
    assert "belongs to trainer 'B'" in (a.refusal(ledger, "pb_g0", "adopt") or "")
    assert "not one this trainer drives" in (Driver.of("A", []).refusal(ledger, "pa_g0", "ack") or "")
    assert "no group of this log" in (a.refusal(ledger, "zz_g0", "ack") or "")
    assert Driver.of(None, ["agent-a"]).debts(ledger, "agent-a") == []  # the unnamed trainer owns none
    # The recovery plan of each flushes its own only.
    plan = plan_recovery(ledger, checkpoints_of(store), "A")
    assert [r.rollout_id for r in plan.debts_to_flush["agent-a"]] == ["pa_g0"]
    assert trainer_debts(ledger, "B")["agent-a"][0].rollout_id == "pb_g0"


def test_the_audit_counts_a_checkpoint_and_a_plan_against_their_own_trainers_debts(
    store: EventStore, log: LogBuilder
) -> None:
    two_trainers_one_agent_name(log)
    log.ack("pb_g0")
    # B's cut over its own agent is clean, though A's debt to its `agent-a` is unpaid.
    log.checkpoint("ckB", trainer="B")
    log.restored(None, None, plan={"debts_to_flush": 0}, trainer="B")
    assert audit_both_ways(store).ok, audit_both_ways(store).as_json()["violations"]
    # A's cut with its own debt unpaid is not, nor a plan of A's that would flush none.
    log.checkpoint("ckA", trainer="A")
    log.restored(None, None, plan={"debts_to_flush": 0}, trainer="A")
    rules = {v.rule for v in audit_both_ways(store).violations}
    assert rules == {CHECKPOINT_CLEAN, DEBT_UNTIL_ACCEPTED}
