"""Rebuilding from any offset and from any stored checkpoint gives the live projection's state."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import create_engine, text

from eventstore import EventStore, RecordedEvent
from projections.audit import audit_log
from projections.base import ReplayRefused, fold_many
from projections.recovery import RolloutRecoveryState
from projections.runner import ProjectionRunner, default_projections, load_replay, rebuild
from projections.sql import list_checkpoints
from tests.projections.builder import LogBuilder
from tests.projections.simulator import Simulator
from trainer.core.recovery import plan_recovery


def live_hashes(events: list[RecordedEvent]) -> list[dict[str, str]]:
    """The live projections' hashes after each event (index = position), folding one event at a time."""
    projections = default_projections()
    states = [p.initial() for p in projections]
    out = [{p.name: p.state_hash(s) for p, s in zip(projections, states, strict=True)}]
    for event in events:
        fold_many(projections, [event], states)
        hashes = {p.name: p.state_hash(s) for p, s in zip(projections, states, strict=True)}
        hashes["recovery"] = RolloutRecoveryState.of(states[0], states[1]).state_hash()
        out.append(hashes)
    return out


def scratch_hashes(events: list[RecordedEvent], upto: int) -> dict[str, str]:
    projections = default_projections()
    states, _ = fold_many(projections, events[:upto])
    hashes = {p.name: p.state_hash(s) for p, s in zip(projections, states, strict=True)}
    if upto:
        hashes["recovery"] = RolloutRecoveryState.of(states[0], states[1]).state_hash()
    return hashes


def without_recovery(hashes: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in hashes.items() if k != "recovery"}


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(rng=st.randoms(use_true_random=False), steps=st.integers(5, 45), every=st.integers(3, 40))
def test_rebuild_from_every_offset_and_checkpoint_equals_live(
    fresh_store: Callable[[], EventStore], rng: random.Random, steps: int, every: int
) -> None:
    store = fresh_store()
    try:
        Simulator(LogBuilder(store), rng).run(steps)
        report = audit_log(store)
        assert report.ok, report.as_json()  # a legal trainer breaks no rule

        runner = ProjectionRunner(store, checkpoint_every=every, keep=None)
        runner.catch_up()
        runner.checkpoint()
        events = list(store.read_all())
        live = live_hashes(events)
        assert runner.replay.hashes() == without_recovery(live[-1])
        plan = plan_recovery(runner.state("ledger"), runner.state("checkpoints"))
        assert plan.position == len(events)

        for offset in range(len(events) + 1):
            assert scratch_hashes(events, offset) == live[offset]
        for c in {c.position for c in list_checkpoints(store)}:
            from_checkpoint = load_replay(store, default_projections(), c)
            assert from_checkpoint.hashes() == without_recovery(live[c])
        for offset in rng.sample(range(1, len(events) + 1), min(5, len(events))):
            rebuilt = rebuild(store, to_position=offset)
            assert rebuilt.position == offset
            assert rebuilt.hashes() == without_recovery(live[offset])
    finally:
        store.close()


def test_tampered_checkpoint_is_refused(store: EventStore, log: LogBuilder) -> None:
    Simulator(log, random.Random(7)).run(20)
    runner = ProjectionRunner(store, checkpoint_every=10)
    runner.catch_up()
    position = max(c.position for c in list_checkpoints(store))
    engine = create_engine(str(store.url))
    with engine.begin() as conn:  # the same JSON value, but not the text that was hashed
        conn.execute(
            text(
                "UPDATE projection_checkpoints SET state = REPLACE(state, '\"position\":', '\"position\": ') "
                "WHERE position = :p AND projection = 'ledger'"
            ),
            {"p": position},
        )
    engine.dispose()
    with pytest.raises(ReplayRefused, match="state hash"):
        load_replay(store, default_projections(), position)
    # A rebuild from scratch does not need the checkpoint.
    assert rebuild(store, from_checkpoint=False).position == store.head()


def test_runner_follows_live_appends(store: EventStore, log: LogBuilder) -> None:
    runner = ProjectionRunner(store, checkpoint_every=10)
    thread = threading.Thread(target=runner.run, kwargs={"idle_exit_s": 1.0, "poll_interval_s": 0.01})
    thread.start()
    simulator = Simulator(log, random.Random(3))
    for _ in range(5):
        simulator.run(5)
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert runner.position == store.head()
    assert runner.replay.hashes() == rebuild(store, from_checkpoint=False).hashes()
    assert store.subscriber_position(runner.name) == store.head()  # the final checkpoint stored its position
