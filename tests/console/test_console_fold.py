"""The console's incremental fold against a rebuild: random legal histories (claims, checkpoints that
archive groups, trainer restores that roll claims back, debts paid and dropped), folded in pages of
random sizes, from position 0 or from a stored projection checkpoint, keep the same counts a scan of
the rebuilt state gives and that `ledger status --json` prints, and the same projection states."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
from typer.testing import CliRunner

from cli.main import app
from console._fold import LiveFold, count_groups, index_steps
from console._overview import build_overview, wanted
from eventstore import EventStore
from projections.generation import GENERATION_EVENTS, generation_figures
from projections.ledger import LedgerProjection
from projections.runner import ProjectionRunner, rebuild
from tests.projections.builder import LogBuilder
from tests.projections.simulator import Simulator


def _fold(store: EventStore, rng: random.Random, start: int = 0) -> LiveFold:
    if start:
        replay = rebuild(store, to_position=start)
        ledger, checkpoints = replay.state("ledger"), replay.state("checkpoints")
    else:
        ledger, checkpoints = LedgerProjection().initial(), rebuild(store, to_position=0).state("checkpoints")
    fold = LiveFold(
        ledger, checkpoints, generation_figures(store.read_all(0, start, types=GENERATION_EVENTS)), start
    )
    events = list(store.read_all(start))
    while events:
        size = rng.randint(1, 40)
        assert fold.apply(events[:size]) == len(events[:size])
        events = events[size:]
    return fold


@pytest.mark.parametrize("seed", range(6))
def test_the_fold_keeps_what_a_rebuild_and_ledger_status_say(
    store: EventStore, log: LogBuilder, db_url: str, seed: int
) -> None:
    rng = random.Random(seed)
    Simulator(log, rng).run(120)
    head = store.head()
    starts = [0, rng.randint(1, head - 1)]
    for start in starts:
        fold = _fold(store, rng, start)
        assert fold.stopped is None and fold.position == head
        replay = rebuild(store)
        assert LedgerProjection().state_hash(fold.ledger) == replay.hashes()["ledger"]
        assert min(fold.groups.values(), default=0) >= 0
        assert +fold.groups == +count_groups(replay.state("ledger"))
        rebuilt = index_steps(replay.state("ledger"))
        assert {k: set(v) for k, v in fold.steps.items() if v} == {k: set(v) for k, v in rebuilt.items()}
        checkpoints = replay.state("checkpoints")
        assert +fold.checkpoint_counts == Counter(c.status for c in checkpoints.checkpoints.values())
        # What `ledger status --json` prints for the same log.
        result = CliRunner().invoke(app, ["status", "--db", db_url, "--json"])
        assert result.exit_code == 0, result.output
        expected = json.loads(result.output)
        counts = fold.status_counts()
        for status, pair in counts.items():
            assert pair == (expected["groups"][status]["in_play"], expected["groups"][status]["archived"])
        assert fold.claimed_counts() == (expected["claimed"]["in_play"], expected["claimed"]["archived"])
        assert fold.generation.summary() == expected["generation"]
        # Debt times are kept only for debts still owed.
        owed = {key for debts in fold.ledger.debts.values() for key in debts}
        assert set(fold.owed_at) <= owed
        overview = build_overview(
            fold,
            phase="live",
            target=head,
            note="",
            times={},
            runner_position=None,
            audit=None,
            verify=None,
            now=0.0,
        )
        assert {d.agent: d.unpaid for d in overview.debts} == {
            agent: v["unpaid"] for agent, v in expected["debts"].items()
        }
        assert wanted(fold).debts <= owed


def test_a_hole_or_an_unreadable_event_stops_the_fold_where_it_is(store: EventStore, log: LogBuilder) -> None:
    log.clean_sibling_group("g1", 2)
    events = list(store.read_all(0))
    fold = _fold(store, random.Random(0), 0)
    assert fold.position == len(events)
    fresh = LiveFold(
        LedgerProjection().initial(),
        rebuild(store, to_position=0).state("checkpoints"),
        generation_figures([]),
        0,
    )
    assert fresh.apply(events[:2] + events[3:]) == 2
    assert fresh.stopped is not None and fresh.stopped.position == 4 and "missing" in fresh.stopped.reason
    assert fresh.apply(events[2:]) == 0  # a stopped fold takes nothing more


def test_the_runner_checkpoint_start_matches_from_scratch(store: EventStore, log: LogBuilder) -> None:
    rng = random.Random(9)
    simulator = Simulator(log, rng)
    simulator.run(80)
    runner = ProjectionRunner(store, checkpoint_every=37)
    runner.catch_up()
    middle = store.head()
    simulator.run(40)
    a, b = _fold(store, rng, 0), _fold(store, rng, middle)
    assert +a.groups == +b.groups and +a.checkpoint_counts == +b.checkpoint_counts
    assert a.generation.summary() == b.generation.summary()
