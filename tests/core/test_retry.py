"""The retry budget: every verdict of protocol.retry."""

from __future__ import annotations

import pytest

from protocol.retry import GiveUp, RetryPolicy, RetryState, backoff_s, next_step

POLICY = RetryPolicy(max_calls=4, deadline_s=10.0, base_s=0.1, cap_s=1.0)


def test_backoff_doubles_from_base_up_to_the_cap_scaled_by_the_jitter_draw() -> None:
    assert [backoff_s(POLICY, n, 0.0) for n in (1, 2, 3, 4, 5, 9)] == [0.05, 0.1, 0.2, 0.4, 0.5, 0.5]
    assert backoff_s(POLICY, 1, 0.999999) == pytest.approx(0.1)


def test_a_jitter_draw_outside_the_unit_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="jitter"):
        backoff_s(POLICY, 1, 1.0)


def test_retry_until_the_calls_are_spent_then_give_up_naming_the_last_error() -> None:
    state = RetryState()
    verdicts = []
    for i in range(4):
        state = state.failed(float(i), f"503 #{i}")
        verdicts.append(next_step(POLICY, state, float(i), 0.5))
    assert [v.kind for v in verdicts] == ["retry", "retry", "retry", "give_up"]
    last = verdicts[-1]
    assert isinstance(last, GiveUp) and "503 #3" in last.reason and "budget 4" in last.reason


def test_the_deadline_gives_up_before_the_calls_are_spent() -> None:
    state = RetryState().failed(100.0, "refused")
    assert next_step(POLICY, state, 109.99, 0.0).kind == "give_up"
    assert next_step(POLICY, state, 100.5, 0.0).kind == "retry"


def test_an_unusable_policy_is_refused() -> None:
    with pytest.raises(ValueError):
        RetryPolicy(max_calls=0, deadline_s=1.0)
