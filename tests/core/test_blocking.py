"""trainer.core.blocking: which tries blocking a prepare are retired, and why, from their own progress."""

from __future__ import annotations

import pytest

from trainer.core.blocking import (
    LAST_RESORT_S,
    STALL_BEATS,
    Blocking,
    Verdict,
    judge,
    last_resort_s,
    stall_after_s,
)


def verdict(
    blocking: list[Blocking], *, heartbeat_s: float | None = 0.5, left_s: float = 50.0, budget: int = 1
) -> Verdict:
    return judge(
        blocking,
        heartbeat_s=heartbeat_s,
        park_grace_s=1.0,
        left_s=left_s,
        last_resort_at_s=5.0,
        max_checkpoint_retires=budget,
        checkpoint_id="ck",
    )


def test_tries_making_progress_are_waited_for_however_long_their_call_lasts() -> None:
    # Another try's progress says nothing about these: each is judged by its own.
    found = verdict([Blocking("a", 0, 0.1, 0), Blocking("b", 0, 1.9, 0)])
    assert found.retire == () and found.protected == ()


def test_a_try_silent_past_its_agents_promise_is_stalled_whatever_the_deadline() -> None:
    found = verdict([Blocking("a", 0, 2.0, 0), Blocking("b", 0, 0.2, 0)])
    assert [(r.rollout_id, r.cause) for r in found.retire] == [("a", "stalled")]
    assert "no progress of its own for 2.0 s" in found.retire[0].reason
    # Stalled even when its rollout already lost a try to a checkpoint: stuck is stuck.
    assert verdict([Blocking("a", 0, 2.0, 5)]).retire[0].cause == "stalled"


def test_without_a_promise_no_try_is_judged_stuck() -> None:
    assert verdict([Blocking("a", 0, 600.0, 0)], heartbeat_s=None).retire == ()
    assert verdict([Blocking("a", 0, None, 0)]).retire == ()


def test_the_last_resort_retires_every_try_still_blocking_for_the_checkpoint() -> None:
    blocking = [Blocking("a", 0, 0.1, 0), Blocking("b", 1, None, 0)]
    assert verdict(blocking, left_s=5.1).retire == ()
    found = verdict(blocking, left_s=5.0)
    assert [(r.rollout_id, r.attempt_index, r.cause) for r in found.retire] == [
        ("a", 0, "checkpoint"),
        ("b", 1, "checkpoint"),
    ]
    assert "retired for checkpoint ck" in found.retire[0].reason and "last resort" in found.retire[0].reason


def test_a_rollout_that_lost_its_share_to_checkpoints_is_never_cancelled_for_one_again() -> None:
    # One protected try: retiring the others would throw their work away for a checkpoint that
    # cannot pass anyway, so none is retired; the prepare waits and names it.
    found = verdict([Blocking("a", 1, 0.1, 1), Blocking("b", 0, 0.1, 0)], left_s=0.5)
    assert found.retire == () and found.protected == (("a", 1),)
    # A stalled try goes all the same, a protected one stays.
    found = verdict([Blocking("a", 1, 0.1, 1), Blocking("b", 0, 3.0, 0)], left_s=0.5)
    assert [(r.rollout_id, r.cause) for r in found.retire] == [("b", "stalled")]
    assert found.protected == (("a", 1),)
    # A budget of 0: a checkpoint never retires a progressing try.
    assert verdict([Blocking("a", 0, 0.1, 0)], left_s=0.0, budget=0).protected == (("a", 0),)
    assert verdict([Blocking("a", 0, 0.1, 1)], left_s=0.0, budget=2).retire[0].cause == "checkpoint"


@pytest.mark.parametrize(
    ("timeout_s", "expected"), [(300.0, LAST_RESORT_S), (60.0, LAST_RESORT_S), (2.0, 0.5)]
)
def test_the_last_resort_leaves_time_for_the_retires(timeout_s: float, expected: float) -> None:
    assert last_resort_s(timeout_s) == expected


def test_the_stall_threshold_is_several_heartbeats_and_at_least_the_grace() -> None:
    assert stall_after_s(0.5, 1.0) == STALL_BEATS * 0.5
    assert stall_after_s(0.1, 1.0) == 1.0
    assert stall_after_s(None, 1.0) is None


def test_the_last_resort_retires_the_rest_beside_the_stalled_and_says_how_close_the_deadline_was() -> None:
    found = verdict([Blocking("a", 2, 2.0, 0), Blocking("b", 3, 0.2, 0)], left_s=0.5)
    assert [(r.rollout_id, r.attempt_index, r.cause) for r in found.retire] == [
        ("a", 2, "stalled"),
        ("b", 3, "checkpoint"),
    ]
    assert found.retire[1].reason == (
        "retired for checkpoint ck: still short of a boundary 0.5 s before its prepare deadline (the last resort)"
    )
