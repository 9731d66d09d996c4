"""The Gym side's tables (participant/states.py) on their own: no server, no registry, no I/O."""

from __future__ import annotations

import re
from collections import deque
from pathlib import Path

import pytest

from participant.states import (
    BLOCKING_STATES,
    CHECKPOINT_OPS,
    DOC_BEGIN,
    DOC_END,
    DONE_STATES,
    EXEC_TRANSITIONS,
    INITIAL,
    LIVE_STATES,
    PHASE_TRANSITIONS,
    RESOURCE_RULES,
    ExecEvent,
    ExecState,
    ExecutionMoveError,
    RestartFromPrompt,
    Resume,
    next_phase,
    next_state,
    resource_table,
    resume_decision,
    with_generated,
)
from protocol.resources import RESOURCE_CLASSES
from protocol.wire import ResourceRevision

DOC = Path(__file__).resolve().parents[2] / "docs" / "state-machines.md"


def test_every_state_has_a_row_and_every_move_lands_on_a_state() -> None:
    assert set(EXEC_TRANSITIONS) == set(ExecState)
    for moves in EXEC_TRANSITIONS.values():
        assert set(moves.values()) <= set(ExecState)


def test_every_state_is_reachable_from_the_start() -> None:
    seen, todo = {INITIAL}, deque([INITIAL])
    while todo:
        for target in EXEC_TRANSITIONS[todo.popleft()].values():
            if target not in seen:
                seen.add(target)
                todo.append(target)
    assert seen == set(ExecState)


def test_a_try_done_for_good_never_comes_back() -> None:
    for state in DONE_STATES:
        assert set(EXEC_TRANSITIONS[state].values()) <= {state}
    assert not DONE_STATES & LIVE_STATES
    assert BLOCKING_STATES < LIVE_STATES


@pytest.mark.parametrize(
    ("state", "event", "expected"),
    [
        (ExecState.RUNNING, ExecEvent.PARK_REQUEST, ExecState.PARK_REQUESTED),
        (ExecState.RUNNING, ExecEvent.BOUNDARY, ExecState.RUNNING),
        (ExecState.PARK_REQUESTED, ExecEvent.BOUNDARY, ExecState.PARKED),
        (ExecState.PARKED, ExecEvent.UNPARK, ExecState.RUNNING),
        (ExecState.PARK_REQUESTED, ExecEvent.COMPLETE, ExecState.COMPLETED),
        (ExecState.PARKED, ExecEvent.CANCEL, ExecState.CANCELLED),
        (ExecState.COMPLETED, ExecEvent.ACKNOWLEDGE, ExecState.ACKNOWLEDGED),
        (ExecState.CANCELLED, ExecEvent.CANCEL, ExecState.CANCELLED),
    ],
)
def test_moves(state: ExecState, event: ExecEvent, expected: ExecState) -> None:
    assert next_state(state, event) is expected


@pytest.mark.parametrize(
    ("state", "event"),
    [
        (ExecState.PARKED, ExecEvent.COMPLETE),  # a parked try waits; it cannot finish
        (ExecState.COMPLETED, ExecEvent.CANCEL),  # retire adopts a finished try, never cancels it
        (ExecState.ACKNOWLEDGED, ExecEvent.ACKNOWLEDGE),
        (ExecState.FAILED, ExecEvent.UNPARK),
        (ExecState.RUNNING, ExecEvent.UNPARK),
    ],
)
def test_a_move_the_table_lacks_raises(state: ExecState, event: ExecEvent) -> None:
    with pytest.raises(ExecutionMoveError):
        next_state(state, event)


def test_phase_fences_come_from_the_phase_table() -> None:
    assert CHECKPOINT_OPS == {
        "prepare": ("idle", "preparing", "prepared"),
        "commit": ("prepared",),
        "resume": ("committed_paused",),
        "abort": ("preparing", "prepared"),
    }
    assert next_phase("committing", "write_failed") == "prepared"
    with pytest.raises(ExecutionMoveError):
        next_phase("committed_paused", "abort")
    for moves in PHASE_TRANSITIONS.values():
        assert set(moves.values()) <= set(PHASE_TRANSITIONS)


def _rev(name: str, cls: str, revision: int = 0) -> ResourceRevision:
    return ResourceRevision.model_validate(
        {"name": name, "resource_class": cls, "session": "s1", "revision": revision}
    )


def test_every_resource_class_has_a_rule() -> None:
    assert set(RESOURCE_RULES) == set(RESOURCE_CLASSES)


def test_a_continuation_that_touched_a_restart_only_resource_restarts_from_the_prompt() -> None:
    decided = resume_decision([_rev("bank", "export_restore", 3), _rev("mailer", "restart_only")])
    assert isinstance(decided, RestartFromPrompt)
    assert "mailer" in decided.reason


def test_a_resume_restores_exactly_the_export_restore_resources() -> None:
    bank = _rev("bank", "export_restore", 3)
    assert resume_decision([bank, _rev("calc", "stateless")]) == Resume((bank,))
    assert resume_decision([]) == Resume(())


def test_the_docs_diagram_is_drawn_from_the_tables() -> None:
    text = DOC.read_text()
    assert with_generated(text) == text, "run `python -m participant.diagrams --write`"


def test_a_move_refused_says_what_was_asked_of_what() -> None:
    said = f"a try in {ExecState.ACKNOWLEDGED.value} cannot take event {ExecEvent.ACKNOWLEDGE.value}"
    with pytest.raises(ExecutionMoveError, match=f"^{said}$"):
        next_state(ExecState.ACKNOWLEDGED, ExecEvent.ACKNOWLEDGE)
    with pytest.raises(ExecutionMoveError, match=r"^checkpoint phase committed_paused has no move abort$"):
        next_phase("committed_paused", "abort")


def test_the_resource_table_says_which_classes_key_their_mutations() -> None:
    rows = {
        line.split("|")[1].strip(): line.split("|")[4].strip() for line in resource_table().splitlines()[2:]
    }
    assert rows == {
        f"`{cls}`": "yes" if rule.keyed_mutations else "no" for cls, rule in RESOURCE_RULES.items()
    }


@pytest.mark.parametrize(
    "doc", ["no markers", f"{DOC_BEGIN}\nbegun, never ended", f"ended, never begun\n{DOC_END}"]
)
def test_a_document_without_both_markers_is_refused(doc: str) -> None:
    # The refusal names both markers, as the writer looks for them.
    expected = f"the document has no generated section between {DOC_BEGIN!r} and {DOC_END!r}"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        with_generated(doc)
