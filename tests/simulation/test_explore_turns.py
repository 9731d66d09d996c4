"""Turn-level resume under faults (simulation/explore_turns.py): seeded schedules with the trainer
crashing, checkpoints retiring tries (also while one takes a continuation up), the agent restarting
with its state kept or lost, continuations lost or corrupted and stale owners resuming earlier
boundaries; the checker finds no completed turn generated twice, no side effect twice, every rollout
finished or out of budget, and it fails when the agent's rule against a superseded boundary is gone."""

from __future__ import annotations

import pytest

from participant.continuations import ContinuationIndex, decide_resume
from simulation import explore_turns as turns


def test_a_slice_of_schedules_keeps_every_completed_turn_once() -> None:
    result = turns.explore_turns(150)
    assert result.violations == {}
    assert set(result.faults) == set(turns.FAULT_P)  # every fault was drawn
    # The paths the faults open were all taken: resumes, and each way a resume is declined.
    assert result.resumes > 50 and result.turns_resumed > result.resumes
    assert {"superseded", "source_live", "restart_only_resource"} <= set(result.declined)
    assert {"continuation_lost", "continuation_corrupt"} & set(result.declined)
    assert result.finished + result.dead_lettered == result.rollouts and result.side_effects > 0
    # Tool calls of retired tries landed late, some after their turn ran again: answered from the record.
    assert result.late_tool_calls > 20 and result.repeats > 5


def test_a_seed_replays_exactly() -> None:
    a, b = turns.run_turn_schedule(17), turns.run_turn_schedule(17)
    assert (a.steps, a.faults, a.generated, a.declined) == (b.steps, b.faults, b.generated, b.declined)


def test_the_checker_fails_an_agent_that_resumes_a_superseded_boundary(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without the rule, a stale owner's late resume of an earlier boundary generates the lineage's
    later turns again and rolls its bank session back under the try that carried it on."""

    def without_the_rule(digest: str, *, index: ContinuationIndex, **kwargs: object) -> object:
        blind = ContinuationIndex(**{**vars(index), "furthest": {}})
        return decide_resume(digest, index=blind, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(turns, "decide_resume", without_the_rule)
    result = turns.explore_turns(150)
    found = [m for ms in result.violations.values() for m in ms]
    assert any("generated again" in m for m in found), found[:5]
