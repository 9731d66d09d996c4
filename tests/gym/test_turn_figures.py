"""What an agent's continuation index says resume saved and what was done twice (turn_figures)."""

from __future__ import annotations

from participant.continuations import ContinuationIndex, IndexRecord, TurnFigures, turn_figures
from protocol.wire import ContinuationRef

ROLLOUT = "g_g0"
PROMPT = "sha256:" + "0" * 64


def _digest(n: int, turn: int) -> str:
    return f"sha256:{n:032x}{turn:032x}"


def _committed(n: int, turn: int, lineage: str) -> IndexRecord:
    ref = ContinuationRef(
        rollout_id=ROLLOUT,
        source_attempt=n,
        lineage=lineage,
        turn=turn,
        digest=_digest(n, turn),
        prompt_digest=PROMPT,
        model_call_ids=[f"call-{t}" for t in range(1, turn + 1)],
        generated_tokens=10 * turn,
    )
    return IndexRecord(
        kind="committed",
        rollout_id=ROLLOUT,
        attempt_index=n,
        digest=ref.digest,
        execution_generation=1,
        at=0.0,
        ref=ref,
    )


def _resumed(n: int, digest: str) -> IndexRecord:
    return IndexRecord(
        kind="resumed", rollout_id=ROLLOUT, attempt_index=n, digest=digest, execution_generation=1, at=0.0
    )


def _index(*records: IndexRecord) -> ContinuationIndex:
    index = ContinuationIndex()
    for rec in records:
        index.apply(rec)
    return index


def test_a_resumed_lineage_redoes_nothing_and_saves_the_turns_it_carried_on_from() -> None:
    # Try 0 commits turns 1..3 and is cut short; try 1 resumes turn 3 and commits 4.
    index = _index(*(_committed(0, t, ROLLOUT) for t in (1, 2, 3)), _resumed(1, _digest(0, 3)))
    index.apply(_committed(1, 4, ROLLOUT))
    assert turn_figures(index) == TurnFigures(
        turns_resumed=3, turns_redone=0, model_tokens_saved=30, resumes=1, declines=0
    )


def test_a_replacement_from_the_prompt_redoes_what_the_earlier_try_had_done() -> None:
    # Try 1 plays from its prompt (a lineage of its own) past where try 0 was cut short.
    index = _index(*(_committed(0, t, ROLLOUT) for t in (1, 2, 3)))
    for t in (1, 2, 3, 4):
        index.apply(_committed(1, t, f"{ROLLOUT}-a1"))
    assert turn_figures(index) == TurnFigures(turns_redone=3)


def test_a_replacement_cut_short_itself_redid_only_as_far_as_it_got() -> None:
    index = _index(*(_committed(0, t, ROLLOUT) for t in (1, 2, 3)), _committed(1, 1, f"{ROLLOUT}-a1"))
    assert turn_figures(index).turns_redone == 1


def test_resuming_an_older_boundary_than_the_furthest_redoes_the_turns_between() -> None:
    # Try 1 resumed turn 3 and reached 5 before it was cut short, but try 2 resumes try 0's turn 3.
    index = _index(*(_committed(0, t, ROLLOUT) for t in (1, 2, 3)), _resumed(1, _digest(0, 3)))
    index.apply(_committed(1, 5, ROLLOUT))
    index.apply(_resumed(2, _digest(0, 3)))
    index.apply(_committed(2, 5, ROLLOUT))
    figures = turn_figures(index)
    assert (figures.turns_resumed, figures.turns_redone, figures.resumes) == (6, 2, 2)
