"""The audit rule of training across restores, folded beside the others in `projections.audit`.

`trained-once` (projections/audit.py) judges claims as the log stands them: a claim a restore rolled
back no longer counts.  That is right only when the state the trainer restored to is the one the log
rolled back to.  A trainer's state is a line of claims: each restore starts a new branch from the
state as it stood at the restore's cut, on whichever branch was current at that position, and the
branch the restore left goes on no further.  A restore to a checkpoint of an abandoned branch (one an
earlier restore left) brings back a state whose claims the log no longer holds, so a claim of one of
its groups is that group trained twice.

- `trained-once-across-restores`: no group is claimed while the state its trainer restored to (and
  every claim since) already holds it, where the log's own claims say it is free (a claim the log
  still holds is `trained-once`'s).

The fold keeps, per trainer, its branches (each with the claims made on it and where it split off its
parent) and the groups its current state holds; a restore rebuilds that set by walking the branch it
returns to back to the first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from pydantic import ConfigDict, with_config

TRAINED_ONCE_ACROSS_RESTORES: Final = "trained-once-across-restores"


@with_config(ConfigDict(extra="forbid"))
@dataclass(slots=True, kw_only=True)
class Branch:
    """One stretch of a trainer's state: from the restore at `start` (0: the first) until the next
    one, grown from `parent`'s state as it stood at position `limit` (None: from no state at all)."""

    start: int
    parent: int | None = None
    limit: int = 0
    # (position, group) of each claim made while this branch was current, in log order.
    claims: list[tuple[int, str]] = field(default_factory=list)


@with_config(ConfigDict(extra="forbid"))
@dataclass(slots=True, kw_only=True)
class TrainerLine:
    branches: list[Branch] = field(default_factory=lambda: [Branch(start=0)])
    # The groups the current state holds: group -> (position of its claim, the restore that brought
    # the state back holding it, if one did).
    held: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    # The newest restore (its position, its checkpoint), for the message.
    restored: tuple[int, str | None] | None = None


@with_config(ConfigDict(extra="forbid"))
@dataclass(slots=True, kw_only=True)
class TrainingFacts:
    # trainer id ("" for the unnamed trainer) -> its line of states
    lines: dict[str, TrainerLine] = field(default_factory=dict)
    # Found so far, for the auditor to report: (rule, positions, message).
    found: list[tuple[str, list[int | None], str]] = field(default_factory=list)

    def _line(self, trainer_id: str | None) -> TrainerLine:
        return self.lines.setdefault(trainer_id or "", TrainerLine())

    def claimed(
        self, position: int, trainer_id: str | None, group_id: str, standing: bool, train_step: int | None
    ) -> None:
        """A claim of `group_id` (of `trainer_id`).  `standing`: the log still holds an earlier claim
        of it (that is `trained-once`'s to report, not this rule's)."""
        line = self._line(trainer_id)
        held = line.held.get(group_id)
        if held is not None and not standing:
            at, by = held
            back = ""
            if by is not None and line.restored is not None:
                back = (
                    f", brought back by its restore at {by} to checkpoint {line.restored[1] or 'none'} "
                    "(a state on a branch an earlier restore had left)"
                )
            self.found.append(
                (
                    TRAINED_ONCE_ACROSS_RESTORES,
                    [at, by, position],
                    f"group {group_id} is claimed for training again (step {train_step}) though the "
                    f"state its trainer holds trained on it at {at}{back}: the log let go of that claim, "
                    "the trainer's state did not",
                )
            )
        line.branches[-1].claims.append((position, group_id))
        line.held[group_id] = (position, None)

    def restored(
        self, position: int, trainer_id: str | None, cut: int | None, checkpoint_id: str | None, kept: bool
    ) -> None:
        """A restore of `trainer_id`'s state to the one at `cut` (None: no state); `kept`: the trainer
        kept its state (only its coordinator's process restarted), so nothing changes."""
        if kept:
            return
        line = self._line(trainer_id)
        if cut is None:
            parent: int | None = None
        else:
            # The branch that was current at `cut`: the newest one started at or before it.
            parent = max(i for i, b in enumerate(line.branches) if b.start <= cut)
        line.branches.append(Branch(start=position, parent=parent, limit=cut or 0))
        line.restored = (position, checkpoint_id)
        line.held = {g: (at, position) for at, g in self._lineage(line, parent, cut or 0)}

    @staticmethod
    def _lineage(line: TrainerLine, index: int | None, limit: int) -> list[tuple[int, str]]:
        """The claims of the state branch `index` stood in at position `limit`, oldest first."""
        found: list[tuple[int, str]] = []
        while index is not None:
            branch = line.branches[index]
            found[:0] = [(at, g) for at, g in branch.claims if at <= limit]
            index, limit = branch.parent, branch.limit
        return found
