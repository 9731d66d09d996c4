"""The seeded exploration of the protocol core (simulation/explore.py): a CI-sized slice, exact
replay, and proof that its history checker fails a core with the old bugs."""

from __future__ import annotations

import pytest

from simulation import explore as sim
from trainer.core import checkpoint as ckpt


def test_ten_thousand_seeded_schedules_hold_every_invariant() -> None:
    result = sim.explore(10_000)
    assert result.ok, dict(list(result.violations.items())[:5])
    # The slice really reaches the hard corners: restarts, lost checkpoints, stuck steps, lost tries.
    assert result.restarts > 1000 and result.lost > 100 and result.stuck > 0 and result.tries_lost > 10


def test_a_seed_replays_exactly() -> None:
    first, again = sim.run_schedule(4242), sim.run_schedule(4242)
    assert [(w, e.model_dump_json()) for w, e in first.log] == [
        (w, e.model_dump_json()) for w, e in again.log
    ]
    assert first.calls == again.calls


def test_the_checker_fails_a_core_that_takes_a_refused_commit_as_done(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Cases 2 and 3 as they were: a commit answered stale/invalid_phase read as "already past this
    step", so the participant is recorded resumed although the agent aborted or lost it."""

    def old_refused(p: ckpt.Participant, answer: ckpt.Refused) -> ckpt.Step:
        if p.op == "commit":
            return ckpt.Step(p.__class__(**{**p.__dict__, "op": "resume"}), ckpt.Call("resume"))
        return ckpt._done(p, p.target)

    monkeypatch.setattr(ckpt, "_refused", old_refused)
    result = sim.explore(500)
    assert not result.ok
    messages = [m for found in result.violations.values() for m in found]
    assert any("holds no artefact" in m or "left" in m for m in messages), messages[:5]


def test_the_checker_fails_an_agent_that_runs_a_try_again_on_adoption(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Case 8 as it was: the re-POST after a restart started the try again."""

    def runs_again(self: sim.ModelAgent, key: str) -> int:
        if self.runs.get(key) != "completed":
            self.started[key] += 1
            self.runs[key], self.completed_in[key] = "completed", self.generation
        return self.completed_in[key]

    monkeypatch.setattr(sim.ModelAgent, "adopt", runs_again)
    result = sim.explore(500)
    assert any("executed" in m for found in result.violations.values() for m in found)
