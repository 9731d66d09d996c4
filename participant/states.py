"""The Gym side's state machines as data: every move a try, the checkpoint phase and a resource may
make lives in this file, and nothing else decides one.

Three tables, read by the execution registry (`participant/executions.py`) and by nothing that does
I/O here: no clock, no asyncio, no disk.

    EXEC_TRANSITIONS   state of a try -> event -> next state.  A move the table lacks raises
                       `ExecutionMoveError`: the registry never sets a state by hand.
    PHASE_TRANSITIONS  checkpoint phase -> operation -> next phase (with the phases each operation is
                       valid from, which the 409 `invalid_phase` answer names).
    RESOURCE_RULES     resource class -> what a turn boundary and a resume do with a resource of it.

`resume_decision` applies RESOURCE_RULES to the resources a continuation touched: resume (restoring the
export/restore ones at their revisions) or restart from the prompt (a restart-only resource was
touched).  `mermaid()` and `resource_table()` draw the diagrams of docs/state-machines.md from the
tables (`python -m participant.diagrams --write` puts them there; a test keeps the doc equal to them).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Final, Literal

from protocol.generated_docs import with_section
from protocol.wire import Phase, ResourceClass, ResourceRevision


class ExecState(StrEnum):
    RUNNING = "RUNNING"
    PARK_REQUESTED = "PARK_REQUESTED"
    PARKED = "PARKED"
    COMPLETED = "COMPLETED"
    ACKNOWLEDGED = "ACKNOWLEDGED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


class ExecEvent(StrEnum):
    """What happens to a try.  `START` creates it (from no state); the rest move it."""

    START = "start"
    # A checkpoint prepare asks it to park at its next turn boundary.
    PARK_REQUEST = "park_request"
    # The runner reached a turn boundary (its continuation, if it saves one, is committed first).
    BOUNDARY = "boundary"
    # The checkpoint was resumed or aborted: parked tries run on.
    UNPARK = "unpark"
    COMPLETE = "complete"
    FAIL = "fail"
    # Retired while live, its task cancelled, or the agent shutting down.
    CANCEL = "cancel"
    ACKNOWLEDGE = "acknowledge"


S, E = ExecState, ExecEvent

# The one source of every move of a try at the agent.
EXEC_TRANSITIONS: Final[dict[ExecState, dict[ExecEvent, ExecState]]] = {
    S.RUNNING: {
        E.PARK_REQUEST: S.PARK_REQUESTED,
        E.BOUNDARY: S.RUNNING,
        E.COMPLETE: S.COMPLETED,
        E.FAIL: S.FAILED,
        E.CANCEL: S.CANCELLED,
    },
    S.PARK_REQUESTED: {
        E.PARK_REQUEST: S.PARK_REQUESTED,
        E.BOUNDARY: S.PARKED,
        E.UNPARK: S.RUNNING,
        # It failed, or was asked to park while its completion was being recorded (a run whose end
        # comes while it is asked parks there first: `Execution.park_at_end`).
        E.COMPLETE: S.COMPLETED,
        E.FAIL: S.FAILED,
        E.CANCEL: S.CANCELLED,
    },
    S.PARKED: {
        E.PARK_REQUEST: S.PARKED,
        E.UNPARK: S.RUNNING,
        E.CANCEL: S.CANCELLED,
    },
    S.COMPLETED: {E.ACKNOWLEDGE: S.ACKNOWLEDGED},
    S.ACKNOWLEDGED: {},
    S.FAILED: {},
    # A retired try's task ends in its own cancellation afterwards: the same fact twice.
    S.CANCELLED: {E.CANCEL: S.CANCELLED},
}
INITIAL: Final = S.RUNNING

LIVE_STATES: Final = frozenset({S.RUNNING, S.PARK_REQUESTED, S.PARKED})
# What keeps a prepare from answering `prepared`.
BLOCKING_STATES: Final = frozenset({S.RUNNING, S.PARK_REQUESTED})
# Out of play for good: the registry keeps only a compact record of these.
DONE_STATES: Final = frozenset({S.ACKNOWLEDGED, S.CANCELLED, S.FAILED})


class ExecutionMoveError(RuntimeError):
    """A move the table does not have: a bug of the registry, never an answer to a caller."""


def next_state(state: ExecState, event: ExecEvent) -> ExecState:
    moves = EXEC_TRANSITIONS[state]
    if event not in moves:
        raise ExecutionMoveError(f"a try in {state.value} cannot take event {event.value}")
    return moves[event]


# --- the checkpoint phase ----------------------------------------------------------------------------

PhaseOp = Literal[
    "prepare", "prepared", "not_ready", "commit", "committed", "write_failed", "resume", "abort"
]

# phase -> operation -> next phase.  `prepare` opens (or joins) a checkpoint; `prepared` / `not_ready`
# end a prepare's wait; `commit` starts writing the artefact, `committed` / `write_failed` end it.
PHASE_TRANSITIONS: Final[dict[Phase, dict[PhaseOp, Phase]]] = {
    "idle": {"prepare": "preparing"},
    "preparing": {"prepare": "preparing", "prepared": "prepared", "not_ready": "preparing", "abort": "idle"},
    "prepared": {
        "prepare": "prepared",
        "prepared": "prepared",
        "not_ready": "preparing",
        "commit": "committing",
        "abort": "idle",
    },
    "committing": {"committed": "committed_paused", "write_failed": "prepared"},
    "committed_paused": {"resume": "idle"},
}

# The operations a trainer calls, and the phases each is valid from (the 409 invalid_phase answer).
CHECKPOINT_OPS: Final[dict[str, tuple[Phase, ...]]] = {
    op: tuple(p for p, moves in PHASE_TRANSITIONS.items() if op in moves)
    for op in ("prepare", "commit", "resume", "abort")
}
# A retire may cancel or tombstone a try only while the agent has not begun committing.
RETIRE_PHASES: Final[tuple[Phase, ...]] = ("idle", "preparing", "prepared")


def next_phase(phase: Phase, op: PhaseOp) -> Phase:
    moves = PHASE_TRANSITIONS[phase]
    if op not in moves:
        raise ExecutionMoveError(f"checkpoint phase {phase} has no move {op}")
    return moves[op]


# --- resources ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResourceRule:
    """What the participant does with a resource of one class."""

    # At a turn boundary: export its state (the revision goes into the continuation), or nothing.
    at_boundary: Literal["export", "nothing"]
    # On a resume: restore it at the continuation's revision, restart the try from the prompt (its
    # state cannot be brought back to the boundary), or nothing.
    on_resume: Literal["restore", "restart_from_prompt", "nothing"]
    # Whether a mutation re-sent with the same key (rollout, lineage, turn, call) is answered from
    # the resource's record of it instead of applied again.
    keyed_mutations: bool
    why: str


RESOURCE_RULES: Final[dict[ResourceClass, ResourceRule]] = {
    "export_restore": ResourceRule(
        "export",
        "restore",
        True,
        "its state at the boundary is exported as a revision and restored on resume; a turn cut short "
        "after the boundary is undone by the restore and its mutations apply once when it runs again",
    ),
    "restart_only": ResourceRule(
        "nothing",
        "restart_from_prompt",
        True,
        "its state cannot be exported: a try that touched it restarts from the prompt on a new "
        "lineage (fresh keys, a fresh session), and only that try",
    ),
    "stateless": ResourceRule("nothing", "nothing", True, "nothing to save or restore"),
}


@dataclass(frozen=True)
class Resume:
    """Resume from the continuation: restore these resources at these revisions first."""

    restore: tuple[ResourceRevision, ...]


@dataclass(frozen=True)
class RestartFromPrompt:
    reason: str


def resume_decision(resources: list[ResourceRevision]) -> Resume | RestartFromPrompt:
    """Whether a continuation that touched `resources` can be resumed, by RESOURCE_RULES."""
    restore: list[ResourceRevision] = []
    for r in resources:
        rule = RESOURCE_RULES[r.resource_class]
        if rule.on_resume == "restart_from_prompt":
            return RestartFromPrompt(f"restart_only_resource: {r.name}")
        if rule.on_resume == "restore":
            restore.append(r)
    return Resume(tuple(restore))


# --- the diagrams of docs/state-machines.md ------------------------------------------------------------

DOC_BEGIN: Final = "<!-- generated by `python -m participant.diagrams --write`: do not edit by hand -->"
DOC_END: Final = "<!-- end of generated -->"


def mermaid() -> str:
    """The execution and phase tables as one mermaid state diagram (every row of both tables)."""
    lines = ["```mermaid", "stateDiagram-v2", "    direction LR", '    state "a try at the agent" as X {']
    lines.append(f"        [*] --> {INITIAL.value}: {E.START.value}")
    for source, moves in EXEC_TRANSITIONS.items():
        for event, target in moves.items():
            lines.append(f"        {source.value} --> {target.value}: {event.value}")
    for done in sorted(DONE_STATES):
        lines.append(f"        {done.value} --> [*]")
    lines += ["    }", '    state "checkpoint phase" as P {']
    for phase, ops in PHASE_TRANSITIONS.items():
        for op, then in ops.items():
            lines.append(f"        {phase} --> {then}: {op}")
    lines += ["    }", "```"]
    return "\n".join(lines)


def resource_table() -> str:
    rows = [
        "| resource class | at a turn boundary | on a resume | keyed mutations | why |",
        "|---|---|---|---|---|",
    ]
    for cls, rule in RESOURCE_RULES.items():
        keyed = "yes" if rule.keyed_mutations else "no"
        rows.append(f"| `{cls}` | {rule.at_boundary} | {rule.on_resume} | {keyed} | {rule.why} |")
    return "\n".join(rows)


def generated_doc() -> str:
    return "\n".join([DOC_BEGIN, "", mermaid(), "", resource_table(), "", DOC_END])


def with_generated(doc: str) -> str:
    """`doc` with the text between DOC_BEGIN and DOC_END replaced by `generated_doc()`."""
    return with_section(doc, DOC_BEGIN, DOC_END, generated_doc())
