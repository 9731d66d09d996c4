"""projections.generation: model time kept and thrown away by checkpoints, folded from the log as the
store returns it, and shown by `ledger status`."""

from __future__ import annotations

from typer.testing import CliRunner

from cli.main import app
from eventstore import EventStore
from eventstore.events import AttemptRetired, GroupAbandoned, ReceiptFetched
from projections.figures import LogFigures
from projections.generation import GENERATION_EVENTS, WARN_SHARE, generation_figures
from protocol.wire import AttemptRef, AttemptWork
from tests.projections.builder import AGENT, LogBuilder, completion_receipt


def receipt(log: LogBuilder, rollout_id: str, n: int, model_s: float, tokens: int) -> None:
    r = completion_receipt(rollout_id, n).model_copy(
        update={"work": AttemptWork(model_s=model_s, generated_tokens=tokens)}
    )
    log.group(rollout_id.rpartition("_g")[0], [ReceiptFetched(agent_name=AGENT, receipt=r)])


def retired(
    log: LogBuilder,
    rollout_id: str,
    n: int,
    model_s: float,
    tokens: int,
    cause: str | None = None,
    checkpoint_id: str | None = None,
) -> None:
    log.group(
        rollout_id.rpartition("_g")[0],
        [
            AttemptRetired(
                rollout_id=rollout_id,
                attempt_index=n,
                outcome="cancelled",
                checkpoint_id=checkpoint_id,
                cause=cause,
                work=AttemptWork(model_s=model_s, generated_tokens=tokens),
            )
        ],
    )


def test_thrown_away_is_what_checkpoints_retired_and_the_rounds_they_took_down(
    store: EventStore, log: LogBuilder
) -> None:
    # Sibling mode: try 0 of s_g0 lost to ck1 after 20 s; try 1 finished (60 s).  A receipt fetched
    # twice (a refetch) counts once.
    log.reserve("s", 1, mode="sibling")
    retired(log, "s_g0", 0, 20.0, 900, "checkpoint", "ck1")
    receipt(log, "s_g0", 1, 60.0, 3000)
    receipt(log, "s_g0", 1, 60.0, 3000)
    # prompt_group: g0 had finished (its receipt: 30 s), g1 was lost to ck2 (10 s); the round is
    # abandoned, so g0's held result goes with it.  The next round finishes (2 x 25 s).
    log.reserve("p", 2, mode="prompt_group")
    receipt(log, "p_g0", 0, 30.0, 1000)
    retired(log, "p_g1", 0, 10.0, 400, "checkpoint", "ck2")
    log.group(
        "p",
        [
            GroupAbandoned(
                group_id="p",
                reason="g1: retired for checkpoint ck2",
                attempts=[
                    AttemptRef(rollout_id="p_g0", attempt_index=0),
                    AttemptRef(rollout_id="p_g1", attempt_index=0),
                ],
            )
        ],
    )
    receipt(log, "p_g0", 1, 25.0, 800)
    receipt(log, "p_g1", 1, 25.0, 800)
    # A stalled try (stuck, the checkpoint's prepare retired it) and a deadline's retire: model time
    # spent, not thrown away by a checkpoint.  A v1 retire (no work) adds nothing.
    log.reserve("x", 1, mode="sibling")
    retired(log, "x_g0", 0, 5.0, 0, "stalled", "ck2")
    retired(log, "x_g0", 1, 4.0, 100)
    log.retire("x_g0", 2, "cancelled")

    figures = generation_figures(store.read_all(0, types=GENERATION_EVENTS))
    assert figures.total.tries == 8
    assert figures.total.model_s == 20 + 60 + 30 + 10 + 25 + 25 + 5 + 4
    assert figures.total.tokens == 900 + 3000 + 1000 + 400 + 800 + 800 + 0 + 100
    assert (figures.thrown.model_s, figures.thrown.tokens, figures.thrown.tries) == (60.0, 2300, 3)
    assert {c: (w.model_s, w.tries) for c, w in figures.by_checkpoint.items()} == {
        "ck1": (20.0, 1),
        "ck2": (40.0, 2),
    }
    assert [c for c, _ in figures.worst(1)] == ["ck2"]
    assert figures.share == 60.0 / 179.0 and figures.share > WARN_SHARE
    assert figures.warning() is not None and "33.5 % of the model time" in (figures.warning() or "")
    # The metrics fold reads the same rows to the same figures.
    snapshot = LogFigures().catch_up(store)
    assert snapshot.generation.thrown == figures.thrown and snapshot.generation.total == figures.total
    flat = LogFigures()
    flat.catch_up(store)
    assert flat.flat()["ledger/thrown_by_checkpoints_share"] == figures.share


def test_status_shows_the_cost_and_warns_above_the_share(
    store: EventStore, log: LogBuilder, db_url: str
) -> None:
    log.reserve("s", 2, mode="sibling")
    receipt(log, "s_g0", 0, 100.0, 5000)
    receipt(log, "s_g1", 0, 100.0, 5000)
    retired(log, "s_g0", 1, 2.0, 50, "checkpoint", "ck-small")  # 1 % of the model time: no warning
    cli = CliRunner()
    out = " ".join(cli.invoke(app, ["status", "--db", db_url]).output.split())
    assert "thrown away by checkpoints: 2.0 s (0.99 %), 50 tokens, 1 tries" in out, out
    assert "ck-small" in out and "warning" not in out
    retired(log, "s_g1", 1, 30.0, 800, "checkpoint", "ck-big")
    out = " ".join(cli.invoke(app, ["status", "--db", db_url]).output.split())
    assert "warning: checkpoints threw away" in out, out
    assert out.index("ck-big") < out.index("ck-small")  # the costliest first
