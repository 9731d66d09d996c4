"""The ledger: groups -> siblings -> tries with their status, and the unpaid ACK debts per agent.

The dataclasses below, with pydantic's `extra="forbid"` config, are the shape
of the state, live and in a projection checkpoint alike: checkpoints are
dumped and validated through one pydantic TypeAdapter over `LedgerState`.
Dataclasses rather than BaseModels because `apply` mutates them in place and
a model's validated `__setattr__`/`__init__` cost more than the fold itself.

Debts (docs/events.md, Invariants: debts): `AckOwed` adds one, `AckAccepted` pays it, and an
`AckRejected` of kind `unknown_execution` drops it only when the agent
incarnation it records differs from the receipt's (the agent restarted and
lost the result, so there is nothing left to ACK); from the incarnation that
made the receipt it is recorded and the debt stays owed (`debt_dropped_by`).  An `AckRejected` of kind
`receipt_mismatch` leaves the debt in place on purpose: the agent still
holds a result the trainer's receipt does not match, so it stays visible as
unpaid (and blocks checkpoint-clean) until an operator looks at it.  An `AckRejected` of
kind `dropped_by_operator` (`ledger debt drop`, with the operator's mark) drops it.

Retire debts (docs/protocol.md, Retire debts): `RetireOwed` adds one (a try declared lost at its agent,
which may still hold a finished result of it), `RetirePaid` pays it (the agent answered the retire; a
result it still held is then owed an ACK, an ordinary debt above).  A group with a retire owed is not
archived, like one with an ACK debt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import ConfigDict, Field, with_config

from eventstore import RecordedEvent
from eventstore.events import (
    AckAccepted,
    AckOwed,
    AckRejected,
    AttemptAdopted,
    AttemptMinted,
    AttemptRetired,
    CheckpointCommitted,
    ContinuationDeclined,
    ContinuationResumed,
    Event,
    GroupAbandoned,
    GroupClaimedForTraining,
    GroupDeadLettered,
    GroupReserved,
    GroupSealed,
    GroupTakenOver,
    Mode,
    PromptRef,
    ReceiptFetched,
    ReplacementMinted,
    RetireCause,
    RetireOwed,
    RetirePaid,
    RolloutReceipt,
    RunDispatched,
    RunFailed,
    RunReplied,
    SiblingHeld,
    SiblingSealed,
    TrainerRestored,
)
from payloads import PayloadClaim
from projections.base import TypedProjection
from protocol.ids import group_id_of
from protocol.levels import TargetLevel
from protocol.streams import group_of_stream, group_stream
from protocol.wire import CompletionReceipt, ContinuationRef, ResumeReport

AttemptStatus = Literal["minted", "dispatched", "replied", "failed", "held", "sealed", "retired", "discarded"]
SiblingStatus = Literal["pending", "held", "sealed"]
GroupStatus = Literal["open", "sealed", "dead_lettered"]
RetireOutcome = Literal["cancelled", "tombstoned", "completed_unacknowledged", "done"]

# A try in one of these states owns its outcome already; a late retire answer does not change it.
_SETTLED: frozenset[str] = frozenset({"held", "sealed", "discarded"})
_FORBID = ConfigDict(extra="forbid")


@with_config(_FORBID)
@dataclass(slots=True, kw_only=True)
class AttemptState:
    rollout_id: str
    attempt_index: int
    status: AttemptStatus = "minted"
    capture_key: str | None = None
    agent_name: str | None = None
    reply_digest: str | None = None
    # Where the reply is stored (None: not kept; a masked reply of an older log).
    reply_claim: PayloadClaim | None = None
    reward: float | None = None
    mask_sample: bool | None = None
    # The reply's own `failure_kind` (the Gym's vocabulary), when it named one.
    failure_kind: str | None = None
    receipt: CompletionReceipt | None = None
    rollout_receipt: RolloutReceipt | None = None
    retire_outcome: RetireOutcome | None = None
    # Set when a checkpoint's prepare retired it (`checkpoint`: lost to a checkpoint, spends no budget).
    retire_cause: RetireCause | None = None
    adopted: bool = False
    failures: list[str] = field(default_factory=list)
    dispatched_position: int | None = None
    minted_position: int = 0
    # Turn-level resume (docs/turns.md): the continuation its agent offered when it was retired, the
    # one this try was minted to resume, and what its agent did with that.
    offered: ContinuationRef | None = None
    continues: ContinuationRef | None = None
    resume: ResumeReport | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.rollout_id, self.attempt_index)


@with_config(_FORBID)
@dataclass(slots=True, kw_only=True)
class SiblingState:
    rollout_id: str
    generation_index: int
    current_attempt: int = 0
    status: SiblingStatus = "pending"
    sealed_attempt: int | None = None
    reward: float | None = None
    attempts: dict[int, AttemptState] = field(default_factory=dict)

    @property
    def current(self) -> AttemptState | None:
        return self.attempts.get(self.current_attempt)


@with_config(_FORBID)
@dataclass(slots=True, kw_only=True)
class ClaimState:
    train_step: int | None
    position: int


@with_config(_FORBID)
@dataclass(slots=True, kw_only=True)
class GroupState:
    group_id: str
    agent_name: str
    mode: Mode
    expected_generations: int
    max_tries: int
    max_infra_failures: int = 4
    max_data_failures: int = 4
    payload: dict[str, Any] = field(default_factory=dict)
    prompt_ref: PromptRef
    target_level: TargetLevel = "sibling"
    # The trainer that owns the group (set at reservation, moved by a take-over).
    trainer_id: str | None = None
    status: GroupStatus = "open"
    # The group stream's last version seen: what a coordinator names as its expected version (fencing).
    stream_version: int = -1
    # prompt_group: group rounds started; sibling: the most tries any one sibling has had.
    attempts_used: int = 0
    abandoned_rounds: int = 0
    claims: list[ClaimState] = field(default_factory=list)
    reserved_position: int = 0
    last_position: int = 0
    siblings: dict[int, SiblingState] = field(default_factory=dict)

    @property
    def claimed_steps(self) -> list[int | None]:
        return [c.train_step for c in self.claims]

    def sibling_of(self, rollout_id: str) -> SiblingState | None:
        prefix = self.group_id + "_g"
        if rollout_id.startswith(prefix) and rollout_id[len(prefix) :].isdigit():
            sibling = self.siblings.get(int(rollout_id[len(prefix) :]))
            if sibling is not None and sibling.rollout_id == rollout_id:
                return sibling
        # Ids that do not follow `<group>_g<index>` (never minted by the coordinator) are looked up.
        return next((s for s in self.siblings.values() if s.rollout_id == rollout_id), None)


@with_config(_FORBID)
@dataclass(slots=True, kw_only=True)
class ArchivedGroup:
    """A group done for good: finished, every debt paid, and its claims behind a committed cut.

    Only this summary is kept (see `_archive`): the full detail of every group
    ever run would make a projection checkpoint grow with the whole history.
    """

    group_id: str
    agent_name: str
    mode: Mode
    status: GroupStatus
    expected_generations: int
    attempts_used: int
    claims: list[ClaimState]
    last_position: int
    trainer_id: str | None = None

    @property
    def claimed_steps(self) -> list[int | None]:
        return [c.train_step for c in self.claims]


@with_config(_FORBID)
@dataclass(slots=True, kw_only=True)
class RetireDebt:
    """A retire owed to an agent for a try declared lost there (`RetireOwed`, at `position`)."""

    rollout_id: str
    attempt_index: int
    position: int
    # The agent process that answered `completed_unacknowledged` for it before it was lost, if one did.
    execution_incarnation: str | None = None


@with_config(_FORBID)
@dataclass(slots=True, kw_only=True)
class LedgerState:
    position: int = 0
    # Every group still in play; groups done for good move to `archived`.
    groups: dict[str, GroupState] = field(default_factory=dict)
    archived: dict[str, ArchivedGroup] = field(default_factory=dict)
    # agent -> "rollout_id/attempt_index" -> the receipt owed an ACK.
    debts: dict[str, dict[str, CompletionReceipt]] = field(default_factory=dict)
    # agent -> "rollout_id/attempt_index" -> the retire owed it (a try declared lost there).
    retires: dict[str, dict[str, RetireDebt]] = field(default_factory=dict)
    # trainer id ("" for the unnamed trainer) -> the cut it stands at: its newest commit's, or the one
    # it restored to since; and the cut up to which its groups are archived (the one before).
    cuts: dict[str, int] = field(default_factory=dict)
    archived_to: dict[str, int] = field(default_factory=dict)
    # Caches, not state: rollout_id -> its sibling, stream -> its group, filled as they are first
    # looked up and emptied of archived groups.  Excluded from dumps, hashes and equality; a loaded
    # state starts with them empty.
    by_rollout: Annotated[dict[str, SiblingState], Field(exclude=True)] = field(
        default_factory=dict, compare=False, repr=False
    )
    by_stream: Annotated[dict[str, GroupState], Field(exclude=True)] = field(
        default_factory=dict, compare=False, repr=False
    )
    # A cache too: the groups in play that are open, and those sealed with no claim, by id (dicts as
    # ordered sets).  None until first asked for (`open_group_ids`: one scan), then kept by the fold
    # (`_track`), so a trainer's loop does not scan every group in play at each batch: between
    # checkpoints that is tens of thousands of groups at NeMo RL's sizes (50,000: 4 ms a scan).
    status_index: Annotated[tuple[dict[str, None], dict[str, None]] | None, Field(exclude=True)] = field(
        default=None, compare=False, repr=False
    )

    def unpaid_debts(self, agent_name: str | None = None) -> list[tuple[str, CompletionReceipt]]:
        """(agent_name, receipt) of every debt not yet paid, oldest first per agent."""
        agents = [agent_name] if agent_name is not None else list(self.debts)
        return [(a, r) for a in agents for r in self.debts.get(a, {}).values()]

    def knows_group(self, group_id: str) -> bool:
        return group_id in self.groups or group_id in self.archived

    def group_of(self, rollout_id: str, stream_id: str = "") -> GroupState | None:
        """The group a try belongs to: by the stream it was appended to, else by its rollout id."""
        gid = group_of_stream(stream_id)
        if gid is not None:
            group = self.groups.get(gid)
            if group is not None:
                return group
        head = group_id_of(rollout_id)
        return self.groups.get(head) if head else None

    def open_group_ids(self) -> list[str]:
        """The groups in play that are open, in the order they were reserved."""
        return self._by_reservation(self._status_index()[0])

    def sealed_unclaimed_ids(self) -> list[str]:
        """The groups in play sealed and not claimed for training, in the order they were reserved."""
        return self._by_reservation(self._status_index()[1])

    def _by_reservation(self, ids: dict[str, None]) -> list[str]:
        return sorted(ids, key=lambda g: self.groups[g].reserved_position)

    def _status_index(self) -> tuple[dict[str, None], dict[str, None]]:
        if self.status_index is None:
            self.status_index = ({}, {})
            for group in self.groups.values():
                _track(self, group)
        return self.status_index

    def sibling(self, rollout_id: str, stream_id: str = "") -> SiblingState | None:
        found = self.by_rollout.get(rollout_id)
        if found is None:
            group = self.group_of(rollout_id, stream_id)
            found = group.sibling_of(rollout_id) if group is not None else None
            if found is not None:
                self.by_rollout[rollout_id] = found
        return found

    def attempt(self, rollout_id: str, attempt_index: int, stream_id: str = "") -> AttemptState | None:
        sibling = self.sibling(rollout_id, stream_id)
        return sibling.attempts.get(attempt_index) if sibling is not None else None


def lookahead(state: LedgerState, group_id: str) -> LedgerState:
    """A ledger to fold a group's not yet written events into, leaving `state` as it is.

    The journal writes several appends to one group in one transaction and lets each build see the
    ones before it in that batch; it applies their events here first.  Holds a copy of the group (of
    every object and container `apply` changes for an event on its stream) and of the debts; the
    archive is shared, since only events of other streams change it.
    """
    group = state.groups.get(group_id)
    return LedgerState(
        position=state.position,
        groups={} if group is None else {group_id: _fork_group(group)},
        archived=state.archived,
        debts={agent: dict(owed) for agent, owed in state.debts.items()},
        retires={agent: dict(owed) for agent, owed in state.retires.items()},
    )


_Slotted = TypeVar("_Slotted", GroupState, SiblingState, AttemptState)


def _shallow(obj: _Slotted) -> _Slotted:
    # Slot by slot: a third of `copy.copy`'s cost, which matters at one copy per group per batch.
    cls = type(obj)
    new = cls.__new__(cls)
    for name in cls.__slots__:
        setattr(new, name, getattr(obj, name))
    return new


def _fork_group(group: GroupState) -> GroupState:
    copy = _shallow(group)
    copy.claims = list(group.claims)
    copy.siblings = {}
    for index, sibling in group.siblings.items():
        forked = copy.siblings[index] = _shallow(sibling)
        forked.attempts = {}
        for n, attempt in sibling.attempts.items():
            forked.attempts[n] = _shallow(attempt)
            forked.attempts[n].failures = list(attempt.failures)
    return copy


def _track(state: LedgerState, group: GroupState) -> None:
    """Keeps `status_index` (once built) true of `group` after a change to its status or claims."""
    if state.status_index is None:
        return
    gid = group.group_id
    for ids, holds in zip(
        state.status_index,
        (group.status == "open", group.status == "sealed" and not group.claims),
        strict=True,
    ):
        if holds:
            ids[gid] = None
        else:
            ids.pop(gid, None)


def debt_key(rollout_id: str, attempt_index: int) -> str:
    # `/` never occurs in an Identifier, so the key splits back unambiguously.
    return f"{rollout_id}/{attempt_index}"


class LedgerProjection(TypedProjection[LedgerState]):
    name: ClassVar[str] = "ledger"
    # 2: groups are archived one checkpoint later (`_committed`), and the cuts kept for it.
    # 3: the retire debts (`retires`).
    version: ClassVar[int] = 3
    state_type: ClassVar[Any] = LedgerState

    def initial(self) -> LedgerState:
        return LedgerState()

    def apply(self, state: LedgerState, event: RecordedEvent, decoded: Event) -> None:
        state.position = event.position
        handler = _HANDLERS.get(decoded.__class__)
        if handler is not None:
            handler(state, event, decoded)
        group = state.by_stream.get(event.stream_id)
        if group is None:
            stream = event.stream_id
            gid = group_of_stream(stream)
            if gid is None:
                return
            group = state.groups.get(gid)
            if group is None:
                return
            state.by_stream[stream] = group
        group.stream_version = event.stream_version
        group.last_position = event.position


# --- handlers: (state, recorded event, decoded payload) -> None -----------------------
# Each tolerates a log that does not make sense (an unknown group, a try never
# minted): it leaves the state alone and the auditor names the event instead.


def _reserved(state: LedgerState, ev: RecordedEvent, e: GroupReserved) -> None:
    if state.knows_group(e.group_id):
        return
    state.groups[e.group_id] = GroupState(
        group_id=e.group_id,
        agent_name=e.agent_name,
        mode=e.mode,
        expected_generations=e.expected_generations,
        max_tries=e.max_tries,
        max_infra_failures=e.max_infra_failures,
        max_data_failures=e.max_data_failures,
        payload=dict(e.payload),
        prompt_ref=e.prompt_ref,
        target_level=e.target_level,
        trainer_id=e.trainer_id,
        stream_version=ev.stream_version,
        reserved_position=ev.position,
        last_position=ev.position,
    )
    _track(state, state.groups[e.group_id])


def _mint(
    state: LedgerState, ev: RecordedEvent, rollout_id: str, generation_index: int, attempt_index: int
) -> None:
    group = state.group_of(rollout_id, ev.stream_id)
    if group is None:
        return
    sibling = group.siblings.get(generation_index)
    if sibling is None:
        sibling = SiblingState(
            rollout_id=rollout_id, generation_index=generation_index, current_attempt=attempt_index
        )
        group.siblings[generation_index] = sibling
        state.by_rollout[rollout_id] = sibling
    elif sibling.rollout_id != rollout_id or attempt_index in sibling.attempts:
        return
    sibling.attempts[attempt_index] = AttemptState(
        rollout_id=rollout_id, attempt_index=attempt_index, minted_position=ev.position
    )
    sibling.current_attempt = attempt_index
    if sibling.status == "held":  # a held result is thrown away with its abandoned group
        sibling.status = "pending"
    if attempt_index + 1 > group.attempts_used:
        group.attempts_used = attempt_index + 1


def _minted(state: LedgerState, ev: RecordedEvent, e: AttemptMinted) -> None:
    _mint(state, ev, e.rollout_id, e.generation_index, e.attempt_index)


def _replacement(state: LedgerState, ev: RecordedEvent, e: ReplacementMinted) -> None:
    _mint(state, ev, e.rollout_id, e.generation_index, e.attempt_index)
    if e.continues is not None:
        attempt = state.attempt(e.rollout_id, e.attempt_index, ev.stream_id)
        if attempt is not None:
            attempt.continues = e.continues


def _resume(state: LedgerState, ev: RecordedEvent, e: ContinuationResumed | ContinuationDeclined) -> None:
    attempt = state.attempt(e.rollout_id, e.attempt_index, ev.stream_id)
    if attempt is not None:
        attempt.resume = e.resume


def _dispatched(state: LedgerState, ev: RecordedEvent, e: RunDispatched) -> None:
    attempt = state.attempt(e.rollout_id, e.attempt_index, ev.stream_id)
    if attempt is None:
        return
    attempt.capture_key = e.capture_key
    attempt.agent_name = e.agent_name
    if attempt.dispatched_position is None:
        attempt.dispatched_position = ev.position
    if attempt.status in ("minted", "failed"):  # a re-dispatch (adoption) re-opens a failed try
        attempt.status = "dispatched"


def _replied(state: LedgerState, ev: RecordedEvent, e: RunReplied) -> None:
    attempt = state.attempt(e.rollout_id, e.attempt_index, ev.stream_id)
    if attempt is None:
        return
    attempt.reward = e.reward
    attempt.mask_sample = e.mask_sample
    attempt.failure_kind = e.failure_kind
    attempt.reply_digest = e.reply_digest
    attempt.reply_claim = e.reply_claim()
    if attempt.status in ("minted", "dispatched", "failed"):
        attempt.status = "replied"


def _failed(state: LedgerState, ev: RecordedEvent, e: RunFailed) -> None:
    attempt = state.attempt(e.rollout_id, e.attempt_index, ev.stream_id)
    if attempt is None:
        return
    attempt.failures.append(f"{e.kind}: {e.reason}")
    if attempt.status in ("minted", "dispatched", "replied"):
        attempt.status = "failed"


def _receipt(state: LedgerState, ev: RecordedEvent, e: ReceiptFetched) -> None:
    attempt = state.attempt(e.receipt.rollout_id, e.receipt.attempt_index, ev.stream_id)
    if attempt is not None:
        attempt.receipt = e.receipt
        if attempt.agent_name is None:
            attempt.agent_name = e.agent_name


def _held(state: LedgerState, ev: RecordedEvent, e: SiblingHeld) -> None:
    sibling = state.sibling(e.rollout_id, ev.stream_id)
    attempt = sibling.attempts.get(e.attempt_index) if sibling is not None else None
    if sibling is None or attempt is None:
        return
    attempt.status = "held"
    attempt.rollout_receipt = e.receipt
    attempt.reward = e.receipt.reward
    if sibling.status != "sealed":
        sibling.status = "held"


def _sealed(state: LedgerState, ev: RecordedEvent, e: SiblingSealed) -> None:
    sibling = state.sibling(e.rollout_id, ev.stream_id)
    attempt = sibling.attempts.get(e.attempt_index) if sibling is not None else None
    if sibling is None or attempt is None:
        return
    attempt.status = "sealed"
    attempt.rollout_receipt = e.receipt
    attempt.reward = e.reward
    sibling.status = "sealed"
    sibling.sealed_attempt = e.attempt_index
    sibling.reward = e.reward


def _group_sealed(state: LedgerState, ev: RecordedEvent, e: GroupSealed) -> None:
    group = state.groups.get(e.group_id)
    if group is not None and group.status == "open":
        group.status = "sealed"
        _track(state, group)


def _abandoned(state: LedgerState, ev: RecordedEvent, e: GroupAbandoned) -> None:
    group = state.groups.get(e.group_id)
    if group is None:
        return
    group.abandoned_rounds += 1
    named = {(a.rollout_id, a.attempt_index) for a in e.attempts}
    for sibling in group.siblings.values():
        for attempt in sibling.attempts.values():
            thrown = (attempt.rollout_id, attempt.attempt_index) in named or (
                not named and attempt.attempt_index == sibling.current_attempt
            )
            if thrown and attempt.status not in ("retired", "sealed", "discarded"):
                attempt.status = "discarded"
        if sibling.status == "held":
            sibling.status = "pending"


def _dead_lettered(state: LedgerState, ev: RecordedEvent, e: GroupDeadLettered) -> None:
    group = state.groups.get(e.group_id)
    if group is not None and group.status == "open":
        group.status = "dead_lettered"
        _track(state, group)


def _claimed(state: LedgerState, ev: RecordedEvent, e: GroupClaimedForTraining) -> None:
    group = state.groups.get(e.group_id)
    if group is not None:
        group.claims.append(ClaimState(train_step=e.train_step, position=ev.position))
        _track(state, group)


def _restored(state: LedgerState, ev: RecordedEvent, e: TrainerRestored) -> None:
    if e.claims_kept:  # the trainer kept its state: only its coordinator's process restarted
        return
    # The trainer rolled back to the cut: claims made after it never reached a kept model.
    cut = e.cut_position if e.cut_position is not None else 0
    if e.cut_position is not None:
        state.cuts[e.trainer_id or ""] = cut
    else:
        state.cuts.pop(e.trainer_id or "", None)
    holders: list[GroupState | ArchivedGroup] = [*state.groups.values(), *state.archived.values()]
    for group in holders:
        if group.trainer_id != e.trainer_id:  # another trainer sharing the log keeps its claims
            continue
        if group.claims and group.claims[-1].position > cut:
            group.claims = [c for c in group.claims if c.position <= cut]
            if isinstance(group, GroupState):
                _track(state, group)


def _committed(state: LedgerState, ev: RecordedEvent, e: CheckpointCommitted) -> None:
    # Archived up to the cut the trainer stood at before this commit, not this one: a trainer may come
    # back on the checkpoint before its newest (it died after the log's commit and before its own
    # save was final), and a restore to it must still find every group claimed since.
    key = e.trainer_id or ""
    previous = state.cuts.get(key)
    state.cuts[key] = e.cut_position
    if previous is not None and previous > state.archived_to.get(key, -1):
        state.archived_to[key] = previous
        _archive(state, previous, e.trainer_id)


def restorable_cut(state: LedgerState, trainer_id: str | None, cut: int | None) -> bool:
    """Whether a restore of `trainer_id` to `cut` (None: to no checkpoint) finds every group it rolls
    claims back on still in play: not archived past it."""
    archived_to = state.archived_to.get(trainer_id or "")
    return archived_to is None or (cut is not None and cut >= archived_to)


def _archive(state: LedgerState, cut: int, trainer_id: str | None) -> None:
    """Moves every group of `trainer_id` that no legal later event can change into `archived`.

    Done for good = sealed and claimed (or dead-lettered), no debt left on any
    of its tries, and everything about it at or before `cut` (the trainer's
    checkpoint before its newest), so a restore to that checkpoint or a later
    one keeps it as it is.  Only the committing trainer's groups: another
    trainer restores to its own cuts.
    """
    owed_keys = [k for owed in state.debts.values() for k in owed]
    owed_keys += [k for retires in state.retires.values() for k in retires]
    indebted = {group_id_of(key.rpartition("/")[0]) for key in owed_keys}
    done = [
        g
        for g in state.groups.values()
        if g.trainer_id == trainer_id
        and g.last_position <= cut
        and g.group_id not in indebted
        and (
            g.status == "dead_lettered"
            or (g.status == "sealed" and g.claims and g.claims[-1].position <= cut)
        )
    ]
    for g in done:
        # Not in `status_index`: a group archived is claimed or dead-lettered, neither open nor unclaimed.
        del state.groups[g.group_id]
        state.by_stream.pop(group_stream(g.group_id), None)
        for sibling in g.siblings.values():
            state.by_rollout.pop(sibling.rollout_id, None)
        state.archived[g.group_id] = ArchivedGroup(
            group_id=g.group_id,
            agent_name=g.agent_name,
            mode=g.mode,
            status=g.status,
            expected_generations=g.expected_generations,
            attempts_used=g.attempts_used,
            claims=g.claims,
            last_position=g.last_position,
            trainer_id=g.trainer_id,
        )


def _ack_owed(state: LedgerState, ev: RecordedEvent, e: AckOwed) -> None:
    state.debts.setdefault(e.agent_name, {})[debt_key(e.receipt.rollout_id, e.receipt.attempt_index)] = (
        e.receipt
    )


def _pay(state: LedgerState, rollout_id: str, attempt_index: int) -> None:
    key = debt_key(rollout_id, attempt_index)
    for agent in list(state.debts):
        owed = state.debts[agent]
        if owed.pop(key, None) is not None and not owed:
            del state.debts[agent]


def _ack_accepted(state: LedgerState, ev: RecordedEvent, e: AckAccepted) -> None:
    _pay(state, e.rollout_id, e.attempt_index)


def _ack_rejected(state: LedgerState, ev: RecordedEvent, e: AckRejected) -> None:
    if debt_dropped_by(e, _owed_receipt(state, e.rollout_id, e.attempt_index)):
        _pay(state, e.rollout_id, e.attempt_index)


def debt_dropped_by(e: AckRejected, owed: CompletionReceipt | None) -> bool:
    """Whether a refusal drops the debt (the one rule: the trainer's core decides by it, the folds
    replay by it): an operator's drop does; an `unknown_execution` only on evidence that the agent lost
    the result, i.e. the process that denies it is another incarnation than the one whose receipt is
    owed (a receipt recorded before incarnations existed was made by another process, too).  Rows
    written before incarnations were recorded keep the rule they were decided under: a newer
    generation (v2, v3), or none at all (v1: dropped as then)."""
    if e.error == "dropped_by_operator":
        return True
    if e.error != "unknown_execution":
        return False
    if owed is None:
        return True
    if e.agent_incarnation is not None:
        return e.agent_incarnation != owed.execution_incarnation
    if e.agent_generation is None:
        return True
    return e.agent_generation > owed.execution_generation


def _owed_receipt(state: LedgerState, rollout_id: str, attempt_index: int) -> CompletionReceipt | None:
    key = debt_key(rollout_id, attempt_index)
    for owed in state.debts.values():
        found = owed.get(key)
        if found is not None:
            return found
    return None


def _retire_owed(state: LedgerState, ev: RecordedEvent, e: RetireOwed) -> None:
    key = debt_key(e.rollout_id, e.attempt_index)
    owed = state.retires.setdefault(e.agent_name, {})
    if key not in owed:  # owed once: a second record of the same loss keeps the first position
        owed[key] = RetireDebt(
            rollout_id=e.rollout_id,
            attempt_index=e.attempt_index,
            position=ev.position,
            execution_incarnation=e.execution_incarnation,
        )


def _retire_paid(state: LedgerState, ev: RecordedEvent, e: RetirePaid) -> None:
    key = debt_key(e.rollout_id, e.attempt_index)
    for agent in list(state.retires):
        owed = state.retires[agent]
        if owed.pop(key, None) is not None and not owed:
            del state.retires[agent]


def _retired(state: LedgerState, ev: RecordedEvent, e: AttemptRetired) -> None:
    attempt = state.attempt(e.rollout_id, e.attempt_index, ev.stream_id)
    if attempt is None:
        return
    attempt.retire_outcome = e.outcome
    if e.cause is not None:
        attempt.retire_cause = e.cause
    if e.continuation is not None:
        attempt.offered = e.continuation
    # completed_unacknowledged: the try finished at the agent and is to be adopted, not retired.
    if e.outcome != "completed_unacknowledged" and attempt.status not in _SETTLED:
        attempt.status = "retired"


def _adopted(state: LedgerState, ev: RecordedEvent, e: AttemptAdopted) -> None:
    attempt = state.attempt(e.rollout_id, e.attempt_index, ev.stream_id)
    if attempt is not None:
        attempt.adopted = True


def _taken_over(state: LedgerState, ev: RecordedEvent, e: GroupTakenOver) -> None:
    group = state.groups.get(e.group_id)
    if group is not None:
        group.trainer_id = e.trainer_id


_HANDLERS: dict[type[Event], Any] = {
    GroupReserved: _reserved,
    GroupTakenOver: _taken_over,
    AttemptMinted: _minted,
    ReplacementMinted: _replacement,
    RunDispatched: _dispatched,
    RunReplied: _replied,
    RunFailed: _failed,
    ReceiptFetched: _receipt,
    SiblingHeld: _held,
    SiblingSealed: _sealed,
    GroupSealed: _group_sealed,
    GroupAbandoned: _abandoned,
    GroupDeadLettered: _dead_lettered,
    GroupClaimedForTraining: _claimed,
    TrainerRestored: _restored,
    AckOwed: _ack_owed,
    AckAccepted: _ack_accepted,
    AckRejected: _ack_rejected,
    AttemptRetired: _retired,
    AttemptAdopted: _adopted,
    RetireOwed: _retire_owed,
    RetirePaid: _retire_paid,
    CheckpointCommitted: _committed,
    ContinuationResumed: _resume,
    ContinuationDeclined: _resume,
}
