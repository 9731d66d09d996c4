"""A trainer restarted while a multi-turn try runs: at target level `turn` the replacement try resumes
the interrupted try's latest committed boundary (no completed turn is generated again), at `sibling`
it plays the whole episode again; the log records the offer, the decision and what the agent did.

The interruption is gated: the try hangs inside the model call of turn 3 (a fault), so its boundary
after turn 2 is committed (the agent's continuations.jsonl says so) when the first coordinator stops
and a second one recovers the log: it retires the try (cancelled, the boundary offered) and mints the
replacement.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from eventstore import EventStore
from eventstore.events import (
    AttemptRetired,
    ContinuationDeclined,
    ContinuationResumed,
    Event,
    GroupAbandoned,
    ReceiptFetched,
    ReplacementMinted,
    SiblingSealed,
)
from participant.continuations import read_index
from projections.audit import audit_log
from protocol.levels import TargetLevel
from protocol.wire import AttemptFault
from tests.rollout.conftest import PAYLOAD, PROMPT, MakeAgent, coordinator, gid
from trainer import RolloutCoordinator
from trainer.gym import GymClient

TURNS = 5
HANG_AT = 3


async def _committed_turn(state_dir: Path, rollout_id: str, turn: int) -> None:
    async with asyncio.timeout(60):
        while True:
            offer = read_index(state_dir).offer(rollout_id, 0)
            if offer is not None and offer.turn >= turn:
                return
            await asyncio.sleep(0.02)


async def _restart_mid_try(
    store: EventStore, make_agent: MakeAgent, tmp_path: Path, level: TargetLevel
) -> tuple[str, list[Event], int]:
    """Runs one single-sibling group at `level`, restarts the trainer inside its try 0, and returns
    (rollout id, the group's events, the tokens the agent generated for try 1, from its receipt)."""
    # No model (each call a fixed small record): a loaded machine never runs a turn past the lease.
    agent = make_agent("a", turns=(TURNS, TURNS), turn_continuation=True, zero_work=True)
    g = gid("tr")
    rid = f"{g}_g0"
    async with GymClient(agent.url, "a") as first, GymClient(agent.url, "a") as second:
        await first.set_faults(AttemptFault(rollout_id=rid, attempt_index=0, hang_at_turn=HANG_AT))
        a = coordinator(store, {"a": first}, mode="sibling", target_level=level, rollout_timeout_s=120)
        await a.start()
        await a.submit(g, PROMPT, "a", 1, PAYLOAD)
        await _committed_turn(tmp_path / "a", rid, HANG_AT - 1)
        await a.close()  # the try stays at the agent, hanging in turn 3
        b = await RolloutCoordinator.recover(store, {"a": second}, mode="sibling", rollout_timeout_s=120)
        await b.wait_idle(60)
        await b.close()
    events = [r.decode() for r in store.read_stream(f"group-{g}")]
    (receipt,) = [e.receipt for e in events if isinstance(e, ReceiptFetched) and e.receipt.attempt_index == 1]
    assert receipt.work is not None
    report = audit_log(store)
    assert report.ok, report.as_json()["violations"]
    return rid, events, receipt.work.generated_tokens


def _one(events: list[Event], kind: type[Event]) -> list[Event]:
    return [e for e in events if isinstance(e, kind)]


@pytest.mark.parametrize("level", ["turn", "sibling"])
async def test_a_trainer_restart_inside_a_try(
    store: EventStore, make_agent: MakeAgent, tmp_path: Path, level: TargetLevel
) -> None:
    rid, events, generated = await _restart_mid_try(store, make_agent, tmp_path, level)
    retired = [e for e in _one(events, AttemptRetired) if isinstance(e, AttemptRetired)]
    assert [(e.attempt_index, e.outcome) for e in retired] == [(0, "cancelled")]
    offer = retired[0].continuation
    # The agent offers the boundary at either level: the level decides whether it is taken up.
    assert offer is not None and offer.turn == HANG_AT - 1 and offer.source_attempt == 0
    assert offer.model_call_ids == [f"call-{n}" for n in range(1, HANG_AT)]
    (replacement,) = [e for e in _one(events, ReplacementMinted) if isinstance(e, ReplacementMinted)]
    (sealed,) = [e for e in _one(events, SiblingSealed) if isinstance(e, SiblingSealed)]
    assert sealed.attempt_index == 1 and sealed.rollout_id == rid
    assert sealed.receipt.model_call_ids == [f"call-{n}" for n in range(1, TURNS + 1)]
    assert not _one(events, ContinuationDeclined)
    if level == "turn":
        assert replacement.continues == offer
        (resumed,) = [e for e in _one(events, ContinuationResumed) if isinstance(e, ContinuationResumed)]
        assert resumed.attempt_index == 1 and resumed.resume.continuation == offer.digest
        assert (resumed.resume.source_attempt, resumed.resume.turn) == (0, HANG_AT - 1)
        assert resumed.resume.reused_model_calls == offer.model_call_ids
        assert resumed.resume.reused_tokens == offer.generated_tokens > 0
        # Only the turns after the boundary were generated by the replacement.
        assert generated == sealed.receipt.token_count - offer.generated_tokens
    else:
        assert replacement.continues is None and not _one(events, ContinuationResumed)
        assert generated == sealed.receipt.token_count  # every turn generated again


@pytest.mark.parametrize("level", ["turn", "sibling"])
async def test_a_trainer_restart_inside_a_prompt_group(
    store: EventStore, make_agent: MakeAgent, tmp_path: Path, level: TargetLevel
) -> None:
    """A prompt group of two: g0 finished and held, g1 hanging inside turn 3 when the trainer restarts.
    At level turn the recovered trainer replaces g1 alone (resuming its boundary) and keeps g0's held
    result: the group is not abandoned and g0 is sealed at its first attempt.  At sibling the round is
    rerun whole: both siblings play again."""
    agent = make_agent("a", turns=(TURNS, TURNS), turn_continuation=True, zero_work=True)
    g = gid("pg")
    held, hung = f"{g}_g0", f"{g}_g1"
    async with GymClient(agent.url, "a") as first, GymClient(agent.url, "a") as second:
        await first.set_faults(AttemptFault(rollout_id=hung, attempt_index=0, hang_at_turn=HANG_AT))
        a = coordinator(store, {"a": first}, mode="prompt_group", target_level=level, rollout_timeout_s=120)
        await a.start()
        await a.submit(g, PROMPT, "a", 2, PAYLOAD)
        await _committed_turn(tmp_path / "a", hung, HANG_AT - 1)
        async with asyncio.timeout(60):
            while a.ledger.groups[g].siblings[0].status != "held":
                await a.wait_changed(0.1)
        await a.close()  # g1 stays at the agent, hanging in turn 3; g0's result is held in the log
        b = await RolloutCoordinator.recover(store, {"a": second}, rollout_timeout_s=120)
        await b.wait_idle(60)
        await b.close()
    events = [r.decode() for r in store.read_stream(f"group-{g}")]
    sealed = {e.rollout_id: e.attempt_index for e in events if isinstance(e, SiblingSealed)}
    replaced = [
        (e.rollout_id, e.attempt_index, e.continues) for e in events if isinstance(e, ReplacementMinted)
    ]
    abandoned = [e for e in events if isinstance(e, GroupAbandoned)]
    if level == "turn":
        assert not abandoned
        assert sealed == {held: 0, hung: 1}
        [(rid, index, continues)] = replaced
        assert (rid, index) == (hung, 1) and continues is not None and continues.turn == HANG_AT - 1
        assert [e.attempt_index for e in _one(events, ContinuationResumed)] == [1]  # type: ignore[attr-defined]
    else:
        assert len(abandoned) == 1 and sealed == {held: 1, hung: 1}
        assert sorted((rid, index) for rid, index, _ in replaced) == [(held, 1), (hung, 1)]
        assert all(continues is None for _, _, continues in replaced)
    report = audit_log(store)
    assert report.ok, report.as_json()["violations"]
