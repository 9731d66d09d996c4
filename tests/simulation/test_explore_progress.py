"""Progress under frequent checkpoints (simulation/explore_progress.py): seeded schedules whose model
calls are longer than the checkpoint interval, the real blocking decision and group rules; every group
sealed or dead-lettered for a reason of its own, and the checker failing the rule that ate runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from simulation import explore_progress as prog
from trainer.core.blocking import Blocking, Retire, Verdict


def test_a_slice_of_schedules_makes_progress_however_often_the_trainer_checkpoints() -> None:
    result = prog.explore_progress(80)
    assert result.ok, dict(list(result.violations.items())[:5])
    # The slice reaches the corners: checkpoints that abort (a protected try, a hang with no
    # heartbeat), work thrown away by the last resort, and cuts that shorten the prepares.
    assert result.groups_sealed > 150 and result.checkpoints > 400 and result.checkpoints_aborted > 0
    assert 0 < result.thrown_s < result.model_s
    cuts, no_cuts = result.prepare_wait_p50_s["cuts"], result.prepare_wait_p50_s["no_cuts"]
    assert cuts is not None and no_cuts is not None and cuts < 1.0 < no_cuts


def test_a_seed_replays_exactly() -> None:
    first, again = prog.run_progress_schedule(77), prog.run_progress_schedule(77)
    assert [(t.rollout_id, t.attempt_index, t.ended, t.model_s) for t in first.tries] == [
        (t.rollout_id, t.attempt_index, t.ended, t.model_s) for t in again.tries
    ]
    assert first.checkpoints == again.checkpoints and first.call_mean_s > first.interval_s


def test_the_checker_fails_the_rule_that_retired_every_try_past_the_park_grace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The rule as it was: a try still short of a boundary after park_grace_s is retired (spending its
    budget), whatever progress of its own it makes."""

    seen = {"first": 0.0, "last": float("inf")}

    def old_judge(blocking: Sequence[Blocking], **kw: Any) -> Verdict:
        if kw["left_s"] >= seen["last"]:  # a new prepare: its first poll has the most time left
            seen["first"] = kw["left_s"]
        seen["last"] = kw["left_s"]
        if seen["first"] - kw["left_s"] < prog.PARK_GRACE_S:
            return Verdict()
        return Verdict(tuple(Retire(b.rollout_id, b.attempt_index, "stalled", "no park") for b in blocking))

    monkeypatch.setattr(prog, "judge", old_judge)
    result = prog.explore_progress(40)
    messages = [m for found in result.violations.values() for m in found]
    assert any("while it made progress" in m for m in messages), messages[:5]
    assert any("dead-lettered by checkpoints" in m for m in messages), messages[:5]
