"""The audit rules of turn-level resume (docs/turns.md), folded beside the others in `projections.audit`.

What the log knows of continuations: the boundary each retired try's agent offered
(`AttemptRetired.continuation`), the one a replacement was told to resume (`ReplacementMinted.continues`),
the prompt digest and continuation each `/run` carried (`RunDispatched` v2), and what the agent did
(`ContinuationResumed`).  Three rules judge them:

- `continuation-as-committed`: a try resumes only the continuation the log recorded: the one its
  `ReplacementMinted.continues` named, which is the replaced try's offer (the boundary its agent
  committed), from the same source try, lineage and turn;
- `resumed-prompt`: the resumed continuation's lineage began from the prompt the try was dispatched
  with (`ContinuationResumed.resume.prompt_digest` is the `RunDispatched.prompt_digest`);
- `turn-executed-twice`: no completed turn runs twice on a resource that cannot undo it: a resume of a
  lineage that touched a `restart_only` resource (whose state no restore brings back), at a turn below
  a boundary another try of that lineage already committed (the turns between ran twice there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from pydantic import ConfigDict, with_config

from protocol.wire import ContinuationRef, ResumeReport

CONTINUATION_AS_COMMITTED: Final = "continuation-as-committed"
RESUMED_PROMPT: Final = "resumed-prompt"
TURN_EXECUTED_TWICE: Final = "turn-executed-twice"
TURN_RULES: Final = (CONTINUATION_AS_COMMITTED, RESUMED_PROMPT, TURN_EXECUTED_TWICE)

# Resource classes whose mutations a resume cannot undo (protocol/resources.py).
_NOT_RESTORABLE: Final = frozenset({"restart_only"})

TryKey = tuple[str, int]


@with_config(ConfigDict(extra="forbid"))
@dataclass(slots=True, kw_only=True)
class LineageFacts:
    # The furthest boundary committed on the lineage, by try, with the position that recorded it.
    reached: dict[int, tuple[int, int]] = field(default_factory=dict)
    # Resources the lineage touched that no restore brings back (name -> position first seen).
    not_restorable: dict[str, int] = field(default_factory=dict)


@with_config(ConfigDict(extra="forbid"))
@dataclass(slots=True, kw_only=True)
class TurnFacts:
    # (rollout, try) -> (position, the offer) of its AttemptRetired.continuation
    offered: dict[TryKey, tuple[int, ContinuationRef]] = field(default_factory=dict)
    # (rollout, try) -> (position, the continuation) its ReplacementMinted told it to resume
    told: dict[TryKey, tuple[int, ContinuationRef]] = field(default_factory=dict)
    # (rollout, try) -> (position, prompt digest) of its first RunDispatched v2
    prompts: dict[TryKey, tuple[int, str]] = field(default_factory=dict)
    lineages: dict[str, LineageFacts] = field(default_factory=dict)
    # Found so far, for the auditor to report: (rule, positions, message).
    found: list[tuple[str, list[int | None], str]] = field(default_factory=list)

    def _lineage(self, ref: ContinuationRef, attempt_index: int, position: int) -> None:
        facts = self.lineages.setdefault(ref.lineage, LineageFacts())
        turn, _ = facts.reached.get(attempt_index, (0, 0))
        if ref.turn > turn:
            facts.reached[attempt_index] = (ref.turn, position)
        for r in ref.resources:
            if r.resource_class in _NOT_RESTORABLE:
                facts.not_restorable.setdefault(r.name, position)

    # --- the events ------------------------------------------------------------------------------

    def retired(
        self, position: int, rollout_id: str, attempt_index: int, offer: ContinuationRef | None
    ) -> None:
        if offer is None:
            return
        self.offered[(rollout_id, attempt_index)] = (position, offer)
        self._lineage(offer, attempt_index, position)

    def replaced(
        self,
        position: int,
        rollout_id: str,
        attempt_index: int,
        replaces: int,
        continues: ContinuationRef | None,
    ) -> None:
        if continues is None:
            return
        self.told[(rollout_id, attempt_index)] = (position, continues)
        offered = self.offered.get((rollout_id, replaces))
        if offered is None or offered[1] != continues:
            self.found.append(
                (
                    CONTINUATION_AS_COMMITTED,
                    [offered[0] if offered else None, position],
                    f"{rollout_id}#{attempt_index} is told to resume {continues.digest}, which is not what "
                    f"#{replaces}'s agent offered when it was retired "
                    f"({offered[1].digest if offered else 'nothing'})",
                )
            )

    def dispatched(
        self, position: int, rollout_id: str, attempt_index: int, prompt_digest: str | None
    ) -> None:
        if prompt_digest is not None:
            self.prompts.setdefault((rollout_id, attempt_index), (position, prompt_digest))

    def resumed(self, position: int, rollout_id: str, attempt_index: int, resume: ResumeReport) -> None:
        key = (rollout_id, attempt_index)
        where = f"{rollout_id}#{attempt_index}"
        told = self.told.get(key)
        if told is None:
            self.found.append(
                (
                    CONTINUATION_AS_COMMITTED,
                    [position],
                    f"{where} resumed {resume.continuation}, but the log told it to resume no continuation",
                )
            )
        else:
            ref = told[1]
            if (resume.continuation, resume.source_attempt, resume.lineage, resume.turn) != (
                ref.digest,
                ref.source_attempt,
                ref.lineage,
                ref.turn,
            ):
                self.found.append(
                    (
                        CONTINUATION_AS_COMMITTED,
                        [told[0], position],
                        f"{where} resumed {resume.continuation} (try #{resume.source_attempt}, lineage "
                        f"{resume.lineage}, turn {resume.turn}), not the committed {ref.digest} it was told to "
                        f"(try #{ref.source_attempt}, lineage {ref.lineage}, turn {ref.turn})",
                    )
                )
        dispatched = self.prompts.get(key)
        if dispatched is not None and resume.prompt_digest != dispatched[1]:
            self.found.append(
                (
                    RESUMED_PROMPT,
                    [dispatched[0], position],
                    f"{where} was dispatched with prompt {dispatched[1]} but resumed a lineage that began from "
                    f"{resume.prompt_digest}",
                )
            )
        self._executed_twice(position, where, attempt_index, resume)

    def _executed_twice(self, position: int, where: str, attempt_index: int, resume: ResumeReport) -> None:
        if resume.lineage is None:
            return
        facts = self.lineages.get(resume.lineage)
        restored = {r.name for r in resume.restored if r.resource_class in _NOT_RESTORABLE}
        if facts is None and not restored:
            return
        not_restorable = dict(facts.not_restorable) if facts is not None else {}
        for name in restored:
            not_restorable.setdefault(name, position)
        if not not_restorable:
            return
        others = {
            n: tp for n, tp in (facts.reached.items() if facts is not None else ()) if n != attempt_index
        }
        beyond = max(others.items(), key=lambda item: item[1][0], default=None)
        if beyond is None or beyond[1][0] <= resume.turn:
            return
        names = ", ".join(sorted(not_restorable))
        self.found.append(
            (
                TURN_EXECUTED_TWICE,
                [beyond[1][1], *not_restorable.values(), position],
                f"{where} resumed lineage {resume.lineage} at turn {resume.turn}, but try #{beyond[0]} had "
                f"committed turn {beyond[1][0]} on it: turns {resume.turn + 1}..{beyond[1][0]} ran twice on "
                f"{names} (restart_only: no restore undoes them)",
            )
        )
