"""The auditor: every invariant of docs/events.md as a named rule, checked in one pass over the log.

Each violation names its rule, the positions of the events involved and a
sentence.  A row the reader cannot use (unknown type or schema version, a
payload that does not validate, a hash that does not verify, a hole in the
positions) is itself a violation: the auditor reports it and carries on.

The rule checks are a fold like any other projection (`AuditProjection`);
the row checks (hash chain, digests of stored projection checkpoints,
decoding) need the full rows and the database around them, so `audit_log`
wraps the fold with them.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final

from pydantic import ConfigDict, with_config

from eventstore import EventStore, RecordedEvent
from eventstore.events import (
    AckAccepted,
    AckOwed,
    AckRejected,
    AttemptMinted,
    AttemptRetired,
    CheckpointAborted,
    CheckpointCommitted,
    CheckpointParticipantFinished,
    CheckpointPrepareStarted,
    CheckpointResumed,
    ContinuationResumed,
    Event,
    GroupAbandoned,
    GroupClaimedForTraining,
    GroupDeadLettered,
    GroupReserved,
    GroupSealed,
    GroupTakenOver,
    PayloadsPruned,
    ReceiptFetched,
    ReplacementMinted,
    RetireOwed,
    RetirePaid,
    RunDispatched,
    RunFailed,
    RunReplied,
    SiblingHeld,
    SiblingSealed,
    TrainerEpochTaken,
    TrainerRestored,
)
from eventstore.records import GENESIS_HASH
from payloads import PayloadPlane
from projections.base import FAST_DECODERS, ReplayRefused, TypedProjection, decode
from projections.digest import BLOCK, StoredDigest
from projections.ledger import debt_dropped_by
from projections.payload_audit import (
    CLAIMS_OF,
    PAYLOAD_RULES,
    PayloadAuditSummary,
    PayloadFacts,
    check_database,
    check_log_blobs,
    check_payloads,
)
from projections.sql import StoredCheckpoint, list_checkpoints, subscriber_positions
from projections.training_audit import TRAINED_ONCE_ACROSS_RESTORES, TrainingFacts
from projections.turn_audit import TURN_RULES, TurnFacts
from protocol.ids import group_id_of, rollout_id_of
from protocol.streams import checkpoint_stream, group_of_stream
from protocol.wire import CompletionReceipt

NO_REUSED_TRY: Final = "no-reused-try"
SEAL_BEFORE_ACK: Final = "seal-before-ack"
DEBT_UNTIL_ACCEPTED: Final = "debt-until-accepted"
NO_STRANDED_RESULT: Final = "no-stranded-result"
# A try held or sealed carries its ACK debt: its AckOwed is the very next row (the one append that
# records the result records the debt), unless it was owed already.
DEBT_WITH_RESULT: Final = "debt-with-result"
# A retire answer of `tombstoned` for a try the agent had finished: it no longer knows the try at all
# (it restarted and lost its stored replies), so it holds nothing that could strand.
_AGENT_HOLDS_NOTHING: Final = frozenset({"tombstoned"})
RETIRE_BEFORE_REPLACE: Final = "retire-before-replace"
RECEIPT_MATCHES: Final = "receipt-matches"
GROUP_SEAL_COMPLETE: Final = "group-seal-complete"
CHECKPOINT_CLEAN: Final = "checkpoint-clean"
HASH_CHAIN: Final = "hash-chain"
TRAINED_ONCE: Final = "trained-once"
BOUNDED_RETRIES: Final = "bounded-retries"
# A claim or checkpoint event written by a process after another took its trainer's owner epoch.
OWNER_EPOCH: Final = "owner-epoch"
# CheckpointResumed only after every participant confirmed it resumed.
RESUMED_BY_EVERY_PARTICIPANT: Final = "resumed-by-every-participant"
# A debt is dropped only with another agent incarnation as evidence, or by an operator's mark.
DEBT_DROPPED_ON_EVIDENCE: Final = "debt-dropped-on-evidence"
# A checkpoint's cut archives, and a restore keeps, only its own trainer's groups and claims.
ARCHIVED_BY_OWN_CUT: Final = "archived-by-own-cut"
# No claim of a trainer's group between its checkpoint's CheckpointPrepareStarted and CheckpointCommitted:
# the trainer saved its state meanwhile, so such a claim is inside the cut but in nothing it saved.
NO_CLAIM_WHILE_PREPARED: Final = "no-claim-while-prepared"
# Every event on a group's (checkpoint's) stream is written by a process of the trainer that owns the group
# (took the checkpoint): a writer is a process of the trainer whose TrainerEpochTaken names it.
ACTS_BY_OWNER: Final = "acts-by-owner"
# Not an invariant of docs/events.md: a row the reader cannot decode, reported rather than skipped silently.
EVENT_READABLE: Final = "event-readable"

RULES: Final = (
    NO_REUSED_TRY,
    SEAL_BEFORE_ACK,
    DEBT_UNTIL_ACCEPTED,
    NO_STRANDED_RESULT,
    DEBT_WITH_RESULT,
    RETIRE_BEFORE_REPLACE,
    RECEIPT_MATCHES,
    GROUP_SEAL_COMPLETE,
    CHECKPOINT_CLEAN,
    HASH_CHAIN,
    TRAINED_ONCE,
    TRAINED_ONCE_ACROSS_RESTORES,
    BOUNDED_RETRIES,
    OWNER_EPOCH,
    RESUMED_BY_EVERY_PARTICIPANT,
    DEBT_DROPPED_ON_EVIDENCE,
    ARCHIVED_BY_OWN_CUT,
    NO_CLAIM_WHILE_PREPARED,
    *TURN_RULES,
    ACTS_BY_OWNER,
    EVENT_READABLE,
)
# Keys of `TrainerRestored.plan` that count the debts a restarted trainer flushes: RecoveryPlan.summary()'s,
# and the coordinator's own summary's.
PLAN_DEBTS_KEYS: Final = ("debts_to_flush", "unpaid_debts")
_MAX_LISTED: Final = 20  # positions named in one violation; the message gives the full count

_FORBID = ConfigDict(extra="forbid")


@with_config(_FORBID)
@dataclass(slots=True, kw_only=True)
class Violation:
    rule: str
    positions: list[int]
    message: str


@with_config(_FORBID)
@dataclass(slots=True, kw_only=True)
class AttemptFacts:
    """What the log has said so far about one try (rollout_id, attempt_index)."""

    group_id: str
    minted: int
    agent: str | None = None
    dispatched: int | None = None
    # The agent process (incarnation) known when the try was dispatched (or its receipt's).
    incarnation: str | None = None
    finished: int | None = None  # first evidence that the agent finished it
    reply_digest: str | None = None
    replied: int | None = None
    fetched: CompletionReceipt | None = None
    fetched_agent: str | None = None
    fetched_at: int | None = None
    owed: int | None = None
    paid: int | None = None
    rejected_unknown: int | None = None
    retire: str | None = None
    retired_at: int | None = None
    # The incarnation that answered the last retire, where the log records it.
    retire_incarnation: str | None = None
    # A retire owed to its agent after the try was declared lost (`RetireOwed`), and its payment
    # (`RetirePaid`: what the agent answered).
    retire_owed: int | None = None
    retire_paid: int | None = None
    retire_paid_outcome: str | None = None
    sealed: int | None = None


@with_config(_FORBID)
@dataclass(slots=True, kw_only=True)
class GroupFacts:
    mode: str
    max_tries: int
    expected_generations: int
    reserved: int
    sealed: int | None = None
    dead: int | None = None
    abandoned: int | None = None
    # The first try whose request the agent refused itself (`RunFailed` kind `refused`): no try after it.
    refused: int | None = None
    trainer_id: str | None = None
    # generation index -> rollout id, from the mints
    siblings: dict[int, str] = field(default_factory=dict)
    # Tries lost to checkpoints (`AttemptRetired` cause `checkpoint`), which spend no budget: per
    # rollout id in sibling mode, the rounds (attempt indexes) in prompt_group mode.
    lost_to_checkpoints: dict[str, int] = field(default_factory=dict)
    rounds_lost_to_checkpoints: list[int] = field(default_factory=list)

    def checkpoint_allowance(self, rollout_id: str) -> int:
        if self.mode == "prompt_group":
            return len(self.rounds_lost_to_checkpoints)
        return self.lost_to_checkpoints.get(rollout_id, 0)


@with_config(_FORBID)
@dataclass(slots=True, kw_only=True)
class CheckpointFacts:
    prepared: int | None = None
    decision: str | None = None
    decided: int | None = None
    trainer_id: str | None = None  # the trainer that prepared it
    cut: int | None = None  # the committed cut
    # participant -> its confirmed outcome (CheckpointParticipantFinished)
    finished: dict[str, str] = field(default_factory=dict)


@with_config(_FORBID)
@dataclass(slots=True, kw_only=True)
class AuditState:
    position: int = 0
    events: int = 0
    groups: dict[str, GroupFacts] = field(default_factory=dict)
    # "rollout_id/attempt_index" -> facts
    tries: dict[str, AttemptFacts] = field(default_factory=dict)
    latest: dict[str, int] = field(default_factory=dict)  # rollout_id -> its newest attempt index
    seals: dict[str, int] = field(default_factory=dict)  # rollout_id -> position of its SiblingSealed
    # agent (`_agent_key`: its trainer's and its name) -> the incarnation first seen last in the log (a
    # process's receipts appear while it lives, so it is the newest process the log knows of;
    # incarnations are never ordered otherwise)
    incarnations: dict[str, str] = field(default_factory=dict)
    seen_incarnations: dict[str, list[str]] = field(default_factory=dict)
    unpaid: dict[str, tuple[int, str]] = field(default_factory=dict)  # try key -> (AckOwed position, agent)
    # (paid position, owed position, agent, try key), in log order: debts as of any past cut.
    payments: list[tuple[int, int, str, str]] = field(default_factory=list)
    checkpoints: dict[str, CheckpointFacts] = field(default_factory=dict)
    claims: dict[str, list[int]] = field(default_factory=dict)  # group -> positions of standing claims
    claim_log: list[tuple[int, str]] = field(default_factory=list)  # standing claims in log order
    # trainer id ("" for the unnamed trainer) -> (writer, position) of its newest TrainerEpochTaken
    owners: dict[str, tuple[str, int]] = field(default_factory=dict)
    # writer (a trainer process, `Journal.writer`) -> its trainer id ("" for the unnamed trainer)
    writers: dict[str, str] = field(default_factory=dict)
    # (stream, writer's trainer) pairs already reported by acts-by-owner: one violation per stream and trainer
    foreign_writes: set[tuple[str, str]] = field(default_factory=set)
    # trainer id ("" for the unnamed trainer) -> the newest cut a checkpoint it prepared committed
    own_cuts: dict[str, int] = field(default_factory=dict)
    # What the log says of continuations (turn-level resume: projections/turn_audit.py).
    turns: TurnFacts = field(default_factory=TurnFacts)
    # Each trainer's line of states across restores (projections/training_audit.py).
    training: TrainingFacts = field(default_factory=TrainingFacts)
    # A try just held or sealed with no debt owed yet: (its key, that row's position); the next row
    # must be its AckOwed (debt-with-result).
    debt_due: tuple[str, int] | None = None
    violations: list[Violation] = field(default_factory=list)

    def violate(self, rule: str, positions: Iterable[int | None], message: str) -> None:
        found = sorted({p for p in positions if p is not None and p > 0})
        self.violations.append(Violation(rule=rule, positions=found[:_MAX_LISTED], message=message))


def _key(rollout_id: str, attempt_index: int) -> str:
    return f"{rollout_id}/{attempt_index}"


def _group_id(event: RecordedEvent, rollout_id: str) -> str:
    gid = group_of_stream(event.stream_id)
    if gid is not None:
        return gid
    return group_id_of(rollout_id)


def _agent_key(st: AuditState, group_id: str, agent: str) -> str:
    """The agent a row of `group_id` names, as the log knows it: its name among its group's trainer's
    agents (projections.ownership.AgentRef); another trainer's agent of that name is another agent."""
    group = st.groups.get(group_id)
    trainer = "" if group is None or group.trainer_id is None else group.trainer_id
    return f"{trainer}\x1f{agent}"


def _owned_by(st: AuditState, key: str, trainer_id: str | None) -> bool:
    """Whether the try (and debt) `key` belongs to `trainer_id`: its group's trainer, as the
    trainer's own check has it (projections.ownership); a try of no known group is nobody's else."""
    group = st.groups.get(group_id_of(key.rpartition("/")[0]))
    return group is None or group.trainer_id == trainer_id


def _lost_with_its_process(t: AttemptFacts) -> bool:
    """A retire answered `done` by another incarnation than the one that held the finished result:
    that process is gone and its result with it (the new one answers `done` for its own tombstone, e.g.
    after the `tombstoned` answer was lost on the way back).  Evidence in the log, as for a debt."""
    return (
        t.retire == "done"
        and t.retire_incarnation is not None
        and t.incarnation is not None
        and t.retire_incarnation != t.incarnation
    )


class AuditProjection(TypedProjection[AuditState]):
    """The rules of docs/events.md over decoded events (the row checks live in `RowChecker`)."""

    name: ClassVar[str] = "audit"
    # 5: owed retires (`AttemptFacts.retire_owed`, `retire_paid`).
    # 6: each trainer's line of states across restores (`AuditState.training`).
    # 7: `AuditState.debt_due`.
    version: ClassVar[int] = 7
    state_type: ClassVar[Any] = AuditState

    def initial(self) -> AuditState:
        return AuditState()

    def apply(self, state: AuditState, event: RecordedEvent, decoded: Event) -> None:
        state.position = event.position
        if state.debt_due is not None:
            _check_debt_due(state, event, decoded)
        handler = _HANDLERS.get(type(decoded))
        if handler is not None:
            handler(state, event, decoded)
        turn_handler = _TURN_HANDLERS.get(type(decoded))
        if turn_handler is not None:
            _apply_turns(state, event.position, decoded, turn_handler)
        _check_acts_by_owner(state, event, decoded)

    def finish(self, state: AuditState) -> None:
        """The checks that need the whole log: finished tries that nothing ever owed."""
        if state.debt_due is not None:  # the log ends on a hold or seal without its debt
            _check_debt_due(state, None, None)
        for key, t in state.tries.items():
            if t.finished is None or t.owed is not None or t.paid is not None:
                continue
            if t.retire in _AGENT_HOLDS_NOTHING and (t.retired_at or 0) > t.finished:
                continue
            if _lost_with_its_process(t):
                continue
            if t.retire_paid is not None and t.retire_paid_outcome != "released":
                continue  # an owed retire answered: the agent holds nothing of the try any more
            rollout_id, _, index = key.rpartition("/")
            later = state.tries.get(_key(rollout_id, int(index) + 1))
            group = state.groups.get(t.group_id)
            moved_on = later.minted if later is not None else None
            if moved_on is None and group is not None:
                moved_on = group.sealed or group.dead
            if moved_on is not None:
                owed = (
                    f"; a retire is owed to its agent since position {t.retire_owed}, not yet paid"
                    if t.retire_owed is not None
                    else ""
                )
                state.violate(
                    NO_STRANDED_RESULT,
                    [t.finished, moved_on, t.retire_owed],
                    f"try {rollout_id}#{index} finished at the agent (position {t.finished}) but no ACK was ever "
                    f"owed for it; the trainer moved on at {moved_on} and left the result stranded{owed}",
                )


# --- the rules, per event type -------------------------------------------------------


def _reserved(st: AuditState, ev: RecordedEvent, e: GroupReserved) -> None:
    if e.group_id not in st.groups:
        st.groups[e.group_id] = GroupFacts(
            mode=e.mode,
            max_tries=e.max_tries,
            expected_generations=e.expected_generations,
            reserved=ev.position,
            trainer_id=e.trainer_id,
        )


def _taken_over(st: AuditState, ev: RecordedEvent, e: GroupTakenOver) -> None:
    group = st.groups.get(e.group_id)
    if group is not None:
        group.trainer_id = e.trainer_id


def _mint(
    st: AuditState, ev: RecordedEvent, rollout_id: str, generation_index: int, index: int
) -> AttemptFacts | None:
    key = _key(rollout_id, index)
    previous = st.tries.get(key)
    if previous is not None:
        st.violate(
            NO_REUSED_TRY,
            [previous.minted, ev.position],
            f"try {rollout_id}#{index} is minted again at {ev.position}, first minted at {previous.minted}",
        )
        return None
    group_id = _group_id(ev, rollout_id)
    group = st.groups.get(group_id)
    if group is not None:
        group.siblings.setdefault(generation_index, rollout_id)
        if group.dead is not None:
            st.violate(
                BOUNDED_RETRIES,
                [group.dead, ev.position],
                f"try {rollout_id}#{index} is minted after group {group_id} was dead-lettered",
            )
        elif group.refused is not None and index > 0:
            st.violate(
                BOUNDED_RETRIES,
                [group.refused, ev.position],
                f"try {rollout_id}#{index} is minted after the agent refused a try of group {group_id} "
                f"as a request it can never serve (at {group.refused}): the same request is retried",
            )
        elif index + 1 > group.max_tries + group.checkpoint_allowance(rollout_id):
            unit = "group" if group.mode == "prompt_group" else "sibling"
            lost = group.checkpoint_allowance(rollout_id)
            st.violate(
                BOUNDED_RETRIES,
                [ev.position],
                f"try {rollout_id}#{index} is try {index + 1} of its {unit}, past the budget of "
                f"{group.max_tries} (and {lost} tries lost to checkpoints); the group should have "
                "been dead-lettered",
            )
    facts = AttemptFacts(group_id=group_id, minted=ev.position)
    st.tries[key] = facts
    return facts


def _minted(st: AuditState, ev: RecordedEvent, e: AttemptMinted) -> None:
    if _mint(st, ev, e.rollout_id, e.generation_index, 0) is not None:
        st.latest.setdefault(e.rollout_id, 0)


def _replacement(st: AuditState, ev: RecordedEvent, e: ReplacementMinted) -> None:
    rid, index, old_index = e.rollout_id, e.attempt_index, e.replaces
    latest = st.latest.get(rid)
    if latest is None:
        st.violate(
            NO_REUSED_TRY, [ev.position], f"replacement {rid}#{index} for a sibling that was never minted"
        )
    elif old_index != latest or index != old_index + 1:
        st.violate(
            NO_REUSED_TRY,
            [st.tries[_key(rid, latest)].minted, ev.position],
            f"replacement {rid}#{index} replaces #{old_index}, but the sibling's newest try is #{latest}: "
            f"a replacement's index must be exactly the previous one + 1",
        )
    old = st.tries.get(_key(rid, old_index))
    if old is not None:
        _check_retired_first(st, ev, rid, old_index, old)
    if _mint(st, ev, rid, e.generation_index, index) is not None:
        st.latest[rid] = max(st.latest.get(rid, index), index)


def _check_retired_first(st: AuditState, ev: RecordedEvent, rid: str, index: int, old: AttemptFacts) -> None:
    if old.owed is not None:
        return  # it finished and the trainer owes (or paid) its ACK
    if old.retire == "completed_unacknowledged":
        st.violate(
            RETIRE_BEFORE_REPLACE,
            [old.retired_at, ev.position],
            f"{rid}#{index} answered completed_unacknowledged at {old.retired_at}, yet a replacement was minted "
            "instead of adopting it: its result strands in the agent",
        )
        return
    if old.retire in ("cancelled", "tombstoned", "done") or old.rejected_unknown is not None:
        return
    if old.dispatched is None:
        return  # never sent to an agent (RunDispatched precedes every /run), so nothing runs there
    restarted = (
        old.agent is not None
        and old.incarnation is not None
        and st.incarnations.get(_agent_key(st, old.group_id, old.agent), old.incarnation) != old.incarnation
    )
    if not restarted:
        st.violate(
            RETIRE_BEFORE_REPLACE,
            [old.dispatched, ev.position],
            f"{rid}#{index + 1} was minted while #{index} may still be running at the agent: no retire answer, "
            "ACK debt or agent restart precedes it",
        )


def _dispatched(st: AuditState, ev: RecordedEvent, e: RunDispatched) -> None:
    t = st.tries.get(_key(e.rollout_id, e.attempt_index))
    if t is None:
        st.violate(
            NO_REUSED_TRY, [ev.position], f"{e.rollout_id}#{e.attempt_index} is dispatched but never minted"
        )
        return
    t.agent = e.agent_name
    if t.dispatched is None:
        t.dispatched = ev.position
    if t.incarnation is None:
        t.incarnation = st.incarnations.get(_agent_key(st, t.group_id, e.agent_name))


def _run_failed(st: AuditState, ev: RecordedEvent, e: RunFailed) -> None:
    if e.kind != "refused":
        return
    group = st.groups.get(_group_id(ev, e.rollout_id))
    if group is not None and group.refused is None:
        group.refused = ev.position


def _replied(st: AuditState, ev: RecordedEvent, e: RunReplied) -> None:
    t = st.tries.get(_key(e.rollout_id, e.attempt_index))
    if t is not None:
        t.reply_digest = e.reply_digest
        t.replied = ev.position
        if t.finished is None:
            t.finished = ev.position


def _process(incarnation: str | None, generation: int | None) -> str | None:
    """The agent process a row names: its incarnation, or in rows recorded before incarnations existed
    its generation (then unique per process: a fresh state directory started at the clock)."""
    if incarnation is not None:
        return incarnation
    return None if generation is None else f"generation-{generation}"


def _see_incarnation(st: AuditState, ev: RecordedEvent, agent_name: str, receipt: CompletionReceipt) -> None:
    incarnation = _process(receipt.execution_incarnation, receipt.execution_generation)
    assert incarnation is not None
    agent = _agent_key(st, _group_id(ev, receipt.rollout_id), agent_name)
    seen = st.seen_incarnations.setdefault(agent, [])
    if incarnation not in seen:
        seen.append(incarnation)
        st.incarnations[agent] = incarnation


def _fetched(st: AuditState, ev: RecordedEvent, e: ReceiptFetched) -> None:
    receipt = e.receipt
    _see_incarnation(st, ev, e.agent_name, receipt)
    t = st.tries.get(_key(receipt.rollout_id, receipt.attempt_index))
    if t is not None:
        t.fetched, t.fetched_agent, t.fetched_at = receipt, e.agent_name, ev.position
        t.incarnation = _process(receipt.execution_incarnation, receipt.execution_generation)
        if t.agent is None:
            t.agent = e.agent_name
        if t.finished is None:
            t.finished = ev.position


def _owed(st: AuditState, ev: RecordedEvent, e: AckOwed) -> None:
    receipt = e.receipt
    _see_incarnation(st, ev, e.agent_name, receipt)
    rid, index = receipt.rollout_id, receipt.attempt_index
    key = _key(rid, index)
    t = st.tries.get(key)
    if t is None:
        st.violate(RECEIPT_MATCHES, [ev.position], f"AckOwed for {rid}#{index}, a try that was never minted")
    elif t.fetched is None:
        st.violate(
            RECEIPT_MATCHES,
            [ev.position],
            f"AckOwed for {rid}#{index}, whose completion receipt was never fetched and checked",
        )
    elif t.fetched != receipt or t.fetched_agent != e.agent_name:
        st.violate(
            RECEIPT_MATCHES,
            [t.fetched_at, ev.position],
            f"the receipt owed for {rid}#{index} differs from the one fetched at {t.fetched_at}",
        )
    # An ACK owed while a retire is owed for the try releases a result nothing takes (docs/protocol.md,
    # Retire debts): it may be another execution's (a stray), so it is not held to the reply's digest.
    releasing = t is not None and t.retire_owed is not None and t.retire_paid is None
    if (
        t is not None
        and t.reply_digest is not None
        and receipt.result_digest != t.reply_digest
        and not releasing
    ):
        st.violate(
            RECEIPT_MATCHES,
            [t.replied, ev.position],
            f"the receipt owed for {rid}#{index} has digest {receipt.result_digest}, the reply had {t.reply_digest}",
        )
    if t is not None:
        t.owed = ev.position
        if t.agent is None:
            t.agent = e.agent_name
    if key not in st.unpaid:
        st.unpaid[key] = (ev.position, e.agent_name)


def _pay(st: AuditState, ev: RecordedEvent, key: str) -> None:
    debt = st.unpaid.pop(key, None)
    if debt is not None:
        st.payments.append((ev.position, debt[0], debt[1], key))


def _accepted(st: AuditState, ev: RecordedEvent, e: AckAccepted) -> None:
    key = _key(e.rollout_id, e.attempt_index)
    t = st.tries.get(key)
    if t is None or t.owed is None:
        st.violate(
            SEAL_BEFORE_ACK,
            [t.fetched_at if t is not None else None, ev.position],
            f"AckAccepted for {e.rollout_id}#{e.attempt_index} with no AckOwed before it: an ACK was sent for a "
            "receipt the trainer had not durably recorded",
        )
    if t is not None and t.paid is None:
        t.paid = ev.position
    _pay(st, ev, key)


def _rejected(st: AuditState, ev: RecordedEvent, e: AckRejected) -> None:
    key = _key(e.rollout_id, e.attempt_index)
    t = st.tries.get(key)
    if t is None or t.owed is None:
        st.violate(
            SEAL_BEFORE_ACK,
            [ev.position],
            f"AckRejected for {e.rollout_id}#{e.attempt_index} with no AckOwed before it: an ACK was sent for a "
            "receipt the trainer had not durably recorded",
        )
    if e.error == "dropped_by_operator":
        # The other evidence a debt may leave on: the operator's mark, with its reason, is in the row.
        if t is not None:
            t.rejected_unknown = ev.position
        _pay(st, ev, key)
    elif e.error == "unknown_execution":
        if not debt_dropped_by(e, t.fetched if t is not None else None):
            return  # recorded as what it is; the debt stays owed (no evidence the agent lost it)
        if e.agent_generation is None and e.agent_incarnation is None:
            st.violate(
                DEBT_DROPPED_ON_EVIDENCE,
                [t.owed if t is not None else None, ev.position],
                f"the debt of {e.rollout_id}#{e.attempt_index} was dropped on an unknown_execution with no "
                "agent incarnation recorded: nothing shows the agent restarted and lost the result",
            )
        if t is not None:
            t.rejected_unknown = ev.position
        _pay(st, ev, key)


def _retired(st: AuditState, ev: RecordedEvent, e: AttemptRetired) -> None:
    t = st.tries.get(_key(e.rollout_id, e.attempt_index))
    if t is None:
        return
    answered = _process(e.execution_incarnation, e.execution_generation)
    t.retire, t.retired_at, t.retire_incarnation = e.outcome, ev.position, answered
    group = st.groups.get(t.group_id)
    if e.cause == "checkpoint" and group is not None:
        if group.mode == "prompt_group":
            if e.attempt_index not in group.rounds_lost_to_checkpoints:
                group.rounds_lost_to_checkpoints.append(e.attempt_index)
        else:
            group.lost_to_checkpoints[e.rollout_id] = group.lost_to_checkpoints.get(e.rollout_id, 0) + 1
    if e.outcome == "completed_unacknowledged":
        if t.finished is None:
            t.finished = ev.position
        if answered is not None:
            t.incarnation = answered  # the process that holds the finished result


def _retire_owed(st: AuditState, ev: RecordedEvent, e: RetireOwed) -> None:
    t = st.tries.get(_key(e.rollout_id, e.attempt_index))
    if t is None:
        return
    if t.retire_owed is None:
        t.retire_owed = ev.position
    elif t.retire_paid is not None:
        # Owed again after it was paid (a stray result of the try): a new debt, unpaid.
        t.retire_owed, t.retire_paid, t.retire_paid_outcome = ev.position, None, None


def _retire_paid(st: AuditState, ev: RecordedEvent, e: RetirePaid) -> None:
    t = st.tries.get(_key(e.rollout_id, e.attempt_index))
    if t is not None and t.retire_paid is None:
        t.retire_paid, t.retire_paid_outcome = ev.position, e.outcome


def _held(st: AuditState, ev: RecordedEvent, e: SiblingHeld) -> None:
    t = st.tries.get(_key(e.rollout_id, e.attempt_index))
    if t is not None and t.finished is None:
        t.finished = ev.position
    _debt_due(st, ev, e.rollout_id, e.attempt_index, t)


def _debt_due(st: AuditState, ev: RecordedEvent, rollout_id: str, index: int, t: AttemptFacts | None) -> None:
    """A try held or sealed: unless its debt is owed already, the next row must be its AckOwed."""
    if t is not None and t.owed is None:
        st.debt_due = (_key(rollout_id, index), ev.position)


def _check_debt_due(st: AuditState, ev: RecordedEvent | None, decoded: Event | None) -> None:
    key, at = st.debt_due or ("", 0)
    st.debt_due = None
    if (
        isinstance(decoded, AckOwed)
        and _key(decoded.receipt.rollout_id, decoded.receipt.attempt_index) == key
    ):
        return
    rid, _, index = key.rpartition("/")
    st.violate(
        DEBT_WITH_RESULT,
        [at, ev.position if ev is not None else None],
        f"try {rid}#{index} was held or sealed at {at} without its ACK debt: its AckOwed is not in the append "
        "that records the result (a crash after it would leave a result the log never owes)",
    )


def _sealed(st: AuditState, ev: RecordedEvent, e: SiblingSealed) -> None:
    first = st.seals.get(e.rollout_id)
    if first is not None:
        st.violate(
            GROUP_SEAL_COMPLETE,
            [first, ev.position],
            f"{e.rollout_id} is sealed a second time at {ev.position} (first at {first})",
        )
    else:
        st.seals[e.rollout_id] = ev.position
    t = st.tries.get(_key(e.rollout_id, e.attempt_index))
    if t is not None:
        t.sealed = ev.position
        if t.finished is None:
            t.finished = ev.position
    _debt_due(st, ev, e.rollout_id, e.attempt_index, t)


def _group_sealed(st: AuditState, ev: RecordedEvent, e: GroupSealed) -> None:
    group = st.groups.get(e.group_id)
    if group is None:
        st.violate(
            GROUP_SEAL_COMPLETE, [ev.position], f"GroupSealed for {e.group_id}, a group never reserved"
        )
        return
    if group.sealed is not None:
        st.violate(GROUP_SEAL_COMPLETE, [group.sealed, ev.position], f"group {e.group_id} is sealed twice")
        return
    group.sealed = ev.position
    missing = []
    for index in range(group.expected_generations):
        rid = group.siblings.get(index, rollout_id_of(e.group_id, index))
        if rid not in st.seals:
            missing.append(rid)
    if missing:
        st.violate(
            GROUP_SEAL_COMPLETE,
            [ev.position],
            f"group {e.group_id} is sealed but {', '.join(missing)} "
            f"{'was' if len(missing) == 1 else 'were'} never sealed",
        )
    for ref in e.attempts:
        t = st.tries.get(_key(ref.rollout_id, ref.attempt_index))
        if t is None or t.sealed is None:
            st.violate(
                GROUP_SEAL_COMPLETE,
                [ev.position],
                f"group {e.group_id} names {ref.rollout_id}#{ref.attempt_index}, a try that was never sealed",
            )


def _abandoned(st: AuditState, ev: RecordedEvent, e: GroupAbandoned) -> None:
    group = st.groups.get(e.group_id)
    if group is not None:
        group.abandoned = ev.position


def _dead(st: AuditState, ev: RecordedEvent, e: GroupDeadLettered) -> None:
    group = st.groups.get(e.group_id)
    if group is not None and group.dead is None:
        group.dead = ev.position


def _epoch(st: AuditState, ev: RecordedEvent, e: TrainerEpochTaken) -> None:
    st.owners[e.trainer_id or ""] = (e.writer, ev.position)
    st.writers[e.writer] = e.trainer_id or ""


def _check_acts_by_owner(st: AuditState, ev: RecordedEvent, decoded: Event) -> None:
    """An event on a group's or a checkpoint's stream written by a process of another trainer than the
    owner's: one trainer acted on another's work (paid or dropped its debt, retired or adopted its try,
    decided its checkpoint).  Rows without a writer (older ones, an operator's, a logprob worker's) and
    writers that took no epoch are not judged; the owner is the group's after this event's own
    reservation or take-over."""
    if not st.writers or '"writer"' not in ev.metadata_json:
        return
    trainer = st.writers.get(ev.metadata.get("writer", ""))
    if trainer is None:
        return
    gid = group_of_stream(ev.stream_id)
    if gid is not None:
        group = st.groups.get(gid)
        if group is None:
            return
        owner, what = group.trainer_id or "", f"group {gid}"
    else:
        cid = getattr(decoded, "checkpoint_id", None)
        facts = st.checkpoints.get(cid) if isinstance(cid, str) else None
        if facts is None or facts.prepared is None or ev.stream_id != checkpoint_stream(cid or ""):
            return
        owner, what = facts.trainer_id or "", f"checkpoint {cid}"
    if trainer == owner or (ev.stream_id, trainer) in st.foreign_writes:
        return
    st.foreign_writes.add((ev.stream_id, trainer))
    st.violate(
        ACTS_BY_OWNER,
        [ev.position],
        f"{ev.type} on {what} of trainer {owner!r} was written by {ev.metadata.get('writer')}, a process of "
        f"trainer {trainer!r}: one trainer acted on another's work",
    )


def _check_owner(st: AuditState, ev: RecordedEvent, trainer_id: str | None, what: str) -> None:
    """`what` must come from the process holding its trainer's newest owner epoch."""
    owner = st.owners.get(trainer_id or "")
    if owner is None:
        return
    writer = ev.metadata.get("writer")
    if writer is not None and writer != owner[0]:
        st.violate(
            OWNER_EPOCH,
            [owner[1], ev.position],
            f"{what} was written by {writer}, a fenced owner of trainer {trainer_id!r}: {owner[0]} took "
            f"its owner epoch at {owner[1]}",
        )


def _claimed(st: AuditState, ev: RecordedEvent, e: GroupClaimedForTraining) -> None:
    claimed_group = st.groups.get(e.group_id)
    _check_owner(st, ev, claimed_group.trainer_id if claimed_group else None, f"the claim of {e.group_id}")
    standing = st.claims.setdefault(e.group_id, [])
    owner = claimed_group.trainer_id if claimed_group else None
    st.training.claimed(ev.position, owner, e.group_id, bool(standing), e.train_step)
    _report(st, st.training.found)
    if standing:
        st.violate(
            TRAINED_ONCE,
            [*standing, ev.position],
            f"group {e.group_id} is claimed for training again (step {e.train_step}) while its claim at "
            f"{standing[-1]} stands: no TrainerRestored rolled it back",
        )
    group = st.groups.get(e.group_id)
    if group is None or group.sealed is None:
        st.violate(
            TRAINED_ONCE,
            [ev.position],
            f"group {e.group_id} is claimed for training (step {e.train_step}) but was never sealed",
        )
    standing.append(ev.position)
    st.claim_log.append((ev.position, e.group_id))


def _restored(st: AuditState, ev: RecordedEvent, e: TrainerRestored) -> None:
    # A trainer rolls back its own claims only; other trainers sharing the log keep theirs.
    cut = e.cut_position if e.cut_position is not None else 0
    as_of = e.plan.get("as_of_position", ev.position)
    kept: list[tuple[int, str]] = []
    rolled_back: dict[str, int] = {}  # group -> its claims rolled back (made before the plan)
    st.training.restored(ev.position, e.trainer_id, e.cut_position, e.checkpoint_id, e.claims_kept)
    if not e.claims_kept:  # else the trainer kept its state: every claim stands
        _check_own_cut(st, ev, e, cut)
    while st.claim_log and st.claim_log[-1][0] > cut and not e.claims_kept:
        position, group_id = st.claim_log.pop()
        group = st.groups.get(group_id)
        if group is not None and group.trainer_id != e.trainer_id:
            kept.append((position, group_id))
            continue
        standing = st.claims.get(group_id, [])
        if position in standing:
            standing.remove(position)
        if position <= as_of:
            rolled_back[group_id] = rolled_back.get(group_id, 0) + 1
    st.claim_log.extend(reversed(kept))
    _check_plan_kept(st, ev, e, cut, rolled_back)
    planned = next((e.plan[k] for k in PLAN_DEBTS_KEYS if k in e.plan), None)
    # This trainer's debts owed by the time the plan was made (other trainers may append between plan
    # and record, and their debts, to agents of the same name perhaps, are theirs to flush).
    unpaid = {k: v for k, v in st.unpaid.items() if v[0] <= as_of and _owned_by(st, k, e.trainer_id)}
    if planned is not None and planned < len(unpaid):
        st.violate(
            DEBT_UNTIL_ACCEPTED,
            [*(p for p, _ in unpaid.values()), ev.position],
            f"the restored trainer plans to flush {planned} ACK debts, but {len(unpaid)} were unpaid: "
            "a debt was dropped without an AckAccepted",
        )


def _check_own_cut(st: AuditState, ev: RecordedEvent, e: TrainerRestored, cut: int) -> None:
    """A trainer restores to a cut of its own: never to another trainer's checkpoint, and never past
    its own newest committed cut over claims of its own (they would be kept by a cut it never took)."""
    facts = st.checkpoints.get(e.checkpoint_id) if e.checkpoint_id is not None else None
    if facts is not None and facts.prepared is not None and facts.trainer_id != e.trainer_id:
        st.violate(
            ARCHIVED_BY_OWN_CUT,
            [facts.decided or facts.prepared, ev.position],
            f"trainer {e.trainer_id!r} restored to checkpoint {e.checkpoint_id}, which trainer "
            f"{facts.trainer_id!r} took: another trainer's cut says nothing of where this one may restore to",
        )
    own = st.own_cuts.get(e.trainer_id or "", 0)
    if cut <= own:
        return
    past = [
        position
        for position, group_id in st.claim_log
        if own < position <= cut
        and (group := st.groups.get(group_id)) is not None
        and group.trainer_id == e.trainer_id
    ]
    if past:
        st.violate(
            ARCHIVED_BY_OWN_CUT,
            [*past, ev.position],
            f"trainer {e.trainer_id!r} restored to cut {cut}, past its own newest committed cut {own}: "
            f"{len(past)} of its claims after {own} are kept by a cut it never committed",
        )


def _check_plan_kept(
    st: AuditState, ev: RecordedEvent, e: TrainerRestored, cut: int, rolled_back: dict[str, int]
) -> None:
    """The plan must roll back every claim of its trainer after the cut, and still hold each group
    they were on as a sealed group to offer again (`sealed_kept`): only a cut of another trainer can
    have archived such a group, since its claim is after every cut of its own trainer."""
    claims = sum(rolled_back.values())
    planned_back = e.plan.get("claims_to_roll_back")
    if planned_back is not None and planned_back < claims:
        st.violate(
            ARCHIVED_BY_OWN_CUT,
            [ev.position],
            f"trainer {e.trainer_id!r} restored to cut {cut} with a plan rolling back {planned_back} "
            f"claim(s), but {claims} of its claims stood after that cut: the plan kept claims that no cut "
            "of its own covers (another trainer's cut archived their groups)",
        )
    kept = e.plan.get("sealed_kept")
    if kept is not None and kept < len(rolled_back):
        names = ", ".join(sorted(rolled_back)[:5])
        st.violate(
            ARCHIVED_BY_OWN_CUT,
            [ev.position],
            f"trainer {e.trainer_id!r} rolled back the claims of {len(rolled_back)} group(s) ({names}) but its "
            f"plan holds only {kept} sealed group(s) to offer again: another trainer's cut archived them, so "
            "they are neither offered nor claimable",
        )


def _prepare(st: AuditState, ev: RecordedEvent, e: CheckpointPrepareStarted) -> None:
    facts = st.checkpoints.setdefault(e.checkpoint_id, CheckpointFacts())
    if facts.prepared is None:
        facts.prepared = ev.position
        facts.trainer_id = e.trainer_id
    _check_owner(st, ev, e.trainer_id, f"the prepare of checkpoint {e.checkpoint_id}")


def _decide(st: AuditState, ev: RecordedEvent, checkpoint_id: str, decision: str) -> CheckpointFacts | None:
    facts = st.checkpoints.setdefault(checkpoint_id, CheckpointFacts())
    if facts.prepared is None:
        st.violate(
            CHECKPOINT_CLEAN,
            [ev.position],
            f"checkpoint {checkpoint_id} is {decision} without a CheckpointPrepareStarted before it",
        )
    if facts.decision is not None and facts.decision != decision:
        st.violate(
            CHECKPOINT_CLEAN,
            [facts.decided, ev.position],
            f"checkpoint {checkpoint_id} is {decision} after it was already {facts.decision}",
        )
        return None
    facts.decision, facts.decided = decision, ev.position
    return facts


def _committed(st: AuditState, ev: RecordedEvent, e: CheckpointCommitted) -> None:
    _check_owner(st, ev, e.trainer_id, f"the commit of checkpoint {e.checkpoint_id}")
    prepared = st.checkpoints.get(e.checkpoint_id)
    # A v1 commit names no trainer (read as the unnamed one's): only a v2 row can name the wrong one.
    if (
        ev.schema_version >= 2
        and prepared is not None
        and prepared.prepared is not None
        and prepared.trainer_id != e.trainer_id
    ):
        st.violate(
            ARCHIVED_BY_OWN_CUT,
            [prepared.prepared, ev.position],
            f"checkpoint {e.checkpoint_id} was prepared by trainer {prepared.trainer_id!r} but its commit names "
            f"trainer {e.trainer_id!r}: the ledger would archive that trainer's groups at a cut it never took",
        )
    facts = _decide(st, ev, e.checkpoint_id, "committed")
    if facts is None:
        return
    cut = e.cut_position
    facts.cut = cut
    # The trainer that prepared it (the checkpoints projection's owner too); the commit's if none did.
    owner = facts.trainer_id if facts.prepared is not None else e.trainer_id
    st.own_cuts[owner or ""] = cut
    _check_no_claim_while_prepared(st, ev, e.checkpoint_id, facts.prepared, owner)
    # Its participants are its trainer's agents: a debt of another trainer's group to an agent of the
    # same name is not this cut's (projections.ownership).
    participants = set(e.participants)
    owed = [
        (owed_at, key)
        for key, (owed_at, agent) in st.unpaid.items()
        if owed_at <= cut and agent in participants and _owned_by(st, key, owner)
    ]
    first_paid_after = bisect.bisect_right(st.payments, (cut, 1 << 62))
    owed += [
        (owed_at, key)
        for _, owed_at, agent, key in st.payments[first_paid_after:]
        if owed_at <= cut and agent in participants and _owned_by(st, key, owner)
    ]
    # The finished tries its prepare carried across the checkpoint: their debts may be unpaid at the cut.
    carried = {_key(r.rollout_id, r.attempt_index) for refs in e.carried.values() for r in refs}
    owed = [(at, key) for at, key in owed if key not in carried]
    if owed:
        owed.sort()
        names = ", ".join(k for _, k in owed[:5]) + (" …" if len(owed) > 5 else "")
        st.violate(
            CHECKPOINT_CLEAN,
            [*(p for p, _ in owed), ev.position],
            f"checkpoint {e.checkpoint_id} committed with {len(owed)} unpaid ACK debt(s) to a participant at "
            f"its cut {cut}: {names}",
        )


def _check_no_claim_while_prepared(
    st: AuditState, ev: RecordedEvent, checkpoint_id: str, prepared: int | None, owner: str | None
) -> None:
    """Standing claims of the committing trainer's groups made after its prepare: inside the cut, yet
    made while the trainer was saving (the claim log is in position order: read from its end)."""
    if prepared is None:
        return
    inside = []
    for position, group_id in reversed(st.claim_log):
        if position <= prepared:
            break
        group = st.groups.get(group_id)
        if group is not None and group.trainer_id == owner:
            inside.append(position)
    if inside:
        st.violate(
            NO_CLAIM_WHILE_PREPARED,
            [prepared, *inside, ev.position],
            f"checkpoint {checkpoint_id} committed {len(inside)} claim(s) made after its prepare at "
            f"{prepared}: they are inside the cut but not in the state the trainer saved, so a restore to "
            "it neither offers nor trains them",
        )


def _resumed(st: AuditState, ev: RecordedEvent, e: CheckpointResumed) -> None:
    facts = st.checkpoints.get(e.checkpoint_id)
    if facts is None or facts.decision != "committed":
        st.violate(
            CHECKPOINT_CLEAN,
            [facts.decided if facts is not None else None, ev.position],
            f"checkpoint {e.checkpoint_id} is resumed but was never committed",
        )
    missing = sorted(p for p in e.participants if facts is None or facts.finished.get(p) != "resumed")
    if missing:
        st.violate(
            RESUMED_BY_EVERY_PARTICIPANT,
            [facts.decided if facts is not None else None, ev.position],
            f"checkpoint {e.checkpoint_id} is resumed in the log but {', '.join(missing)} never confirmed "
            "it resumed (no CheckpointParticipantFinished resumed)",
        )


def _participant_finished(st: AuditState, ev: RecordedEvent, e: CheckpointParticipantFinished) -> None:
    facts = st.checkpoints.setdefault(e.checkpoint_id, CheckpointFacts())
    facts.finished[e.agent_name] = e.outcome


def _aborted(st: AuditState, ev: RecordedEvent, e: CheckpointAborted) -> None:
    _decide(st, ev, e.checkpoint_id, "aborted")


_HANDLERS: dict[type[Event], Callable[[AuditState, RecordedEvent, Any], None]] = {
    GroupReserved: _reserved,
    AttemptMinted: _minted,
    ReplacementMinted: _replacement,
    RunDispatched: _dispatched,
    RunReplied: _replied,
    RunFailed: _run_failed,
    ReceiptFetched: _fetched,
    AckOwed: _owed,
    AckAccepted: _accepted,
    AckRejected: _rejected,
    AttemptRetired: _retired,
    RetireOwed: _retire_owed,
    RetirePaid: _retire_paid,
    SiblingHeld: _held,
    SiblingSealed: _sealed,
    GroupSealed: _group_sealed,
    GroupAbandoned: _abandoned,
    GroupDeadLettered: _dead,
    GroupClaimedForTraining: _claimed,
    TrainerRestored: _restored,
    GroupTakenOver: _taken_over,
    CheckpointPrepareStarted: _prepare,
    CheckpointCommitted: _committed,
    CheckpointResumed: _resumed,
    CheckpointAborted: _aborted,
    CheckpointParticipantFinished: _participant_finished,
    TrainerEpochTaken: _epoch,
}

# The continuation rules' fold (projections/turn_audit.py): what each event tells it.
_TURN_HANDLERS: dict[type[Event], Callable[[TurnFacts, int, Any], None]] = {
    AttemptRetired: lambda t, p, e: t.retired(p, e.rollout_id, e.attempt_index, e.continuation),
    ReplacementMinted: lambda t, p, e: t.replaced(p, e.rollout_id, e.attempt_index, e.replaces, e.continues),
    RunDispatched: lambda t, p, e: t.dispatched(p, e.rollout_id, e.attempt_index, e.prompt_digest),
    ContinuationResumed: lambda t, p, e: t.resumed(p, e.rollout_id, e.attempt_index, e.resume),
}


def _apply_turns(
    st: AuditState, position: int, decoded: Event, handler: Callable[[TurnFacts, int, Any], None]
) -> None:
    handler(st.turns, position, decoded)
    _report(st, st.turns.found)


def _report(st: AuditState, found: list[tuple[str, list[int | None], str]]) -> None:
    """The violations a side fold (turns, training) found, reported and cleared."""
    for rule, positions, message in found:
        st.violate(rule, positions, message)
    found.clear()


# --- the row checks and the whole audit -----------------------------------------------


@dataclass(slots=True)
class RowChecker:
    """Per-row checks that need the full stored row: positions, the per-stream chain, the hash, decoding."""

    expected_position: int = 1
    streams: dict[str, tuple[int, str]] = field(default_factory=dict)

    def check(self, st: AuditState, ev: RecordedEvent) -> None:
        position = ev.position
        if position != self.expected_position:
            if position > self.expected_position:
                st.violate(
                    HASH_CHAIN,
                    [self.expected_position - 1, position],
                    f"positions {self.expected_position}..{position - 1} are missing: rows were deleted",
                )
            else:
                st.violate(HASH_CHAIN, [position], f"position {position} is out of order")
        self.expected_position = position + 1
        version, prev = self.streams.get(ev.stream_id, (-1, GENESIS_HASH))
        if ev.stream_version != version + 1:
            st.violate(
                HASH_CHAIN,
                [position],
                f"stream {ev.stream_id!r} jumps from version {version} to {ev.stream_version}: rows were deleted",
            )
        elif ev.prev_hash != prev:
            st.violate(
                HASH_CHAIN,
                [position],
                f"prev_hash of position {position} does not match the hash of {ev.stream_id!r} v{version}",
            )
        if ev.hash != ev.expected_hash():
            st.violate(
                HASH_CHAIN, [position], f"the hash of position {position} does not match its content: edited"
            )
        self.streams[ev.stream_id] = (ev.stream_version, ev.hash)


@dataclass(slots=True)
class AuditReport:
    events: int
    head: int
    rules_checked: list[str]
    violations: list[Violation]
    # What the payload checks read (audit_log only: audit_events sees the events alone).
    payloads: PayloadAuditSummary | None = None

    @property
    def ok(self) -> bool:
        return not self.violations

    def as_json(self) -> dict[str, Any]:
        return {
            "events": self.events,
            "rules_checked": list(self.rules_checked),
            "violations": [
                {"rule": v.rule, "positions": v.positions, "message": v.message} for v in self.violations
            ],
            "payloads": None if self.payloads is None else self.payloads.as_json(),
        }


def audit_events(
    events: Iterable[RecordedEvent],
    checkpoints: Iterable[StoredCheckpoint] = (),
    subscribers: dict[str, int] | None = None,
    progress: Callable[[int], None] | None = None,
    payloads: PayloadFacts | None = None,
) -> AuditReport:
    """Audits `events` (full rows, position order from 1); stored checkpoint digests are compared on the way.
    With `payloads`, the claims the events carry are gathered into it (audit_log then reads them back)."""
    projection = AuditProjection()
    st = projection.initial()
    rows = RowChecker()
    check = rows.check
    handlers = _HANDLERS
    turn_handlers = _TURN_HANDLERS
    fast = FAST_DECODERS
    # position -> the digests stored at it (one per projection); checked as the pass reaches them.
    digests: dict[int, list[StoredCheckpoint]] = {}
    for c in checkpoints:
        digests.setdefault(c.position, []).append(c)
    block_digest, block_position, pending = "0" * 64, 0, []
    position = 0
    count = 0
    for ev in events:
        check(st, ev)
        position = ev.position
        pending.append(ev.hash)
        if not position & (BLOCK - 1):
            block_digest, block_position = _sha(block_digest + "".join(pending)), position
            pending = []
        stored = digests.pop(position, None)
        if stored is not None:
            _check_digests(st, stored, block_position, block_digest, _sha(block_digest + "".join(pending)))
        # `decode`'s fast path inlined, as in the runner; anything unusual takes the full path.
        entry = fast.get(ev.type)
        decoded = None
        if entry is not None and entry[0] == ev.schema_version:
            try:  # noqa: SIM105 (a context manager per event costs more than the decode saves)
                decoded = entry[1].validate_json(ev.data_json)
            except ValueError:
                pass
        if decoded is None:
            try:
                decoded = decode(ev)
            except ReplayRefused as exc:
                st.violate(EVENT_READABLE, [position], f"{exc.reason}; the auditor skipped this event")
        if decoded is not None:
            st.position = position
            if st.debt_due is not None:
                _check_debt_due(st, ev, decoded)
            handler = handlers.get(decoded.__class__)
            if handler is not None:
                handler(st, ev, decoded)
            turn_handler = turn_handlers.get(decoded.__class__)
            if turn_handler is not None:
                _apply_turns(st, position, decoded, turn_handler)
            _check_acts_by_owner(st, ev, decoded)
            claimed = None if payloads is None else CLAIMS_OF.get(decoded.__class__)
            if claimed is not None and payloads is not None:
                payloads.see(position, claimed(decoded))
                payloads.see_try(decoded, position)
            elif payloads is not None and isinstance(decoded, PayloadsPruned):
                payloads.see_pruned(position, decoded.digests)
        count += 1
        if progress is not None and count % 10_000 == 0:
            progress(10_000)
    if progress is not None:
        progress(count % 10_000)
    st.events = count
    projection.finish(st)
    for at, stored in sorted(digests.items()):
        st.violate(
            HASH_CHAIN,
            [position, at],
            f"a {stored[0].projection} checkpoint was stored at position {at} but the log ends at {position}: "
            "events were removed from its end",
        )
    for name, at in sorted((subscribers or {}).items()):
        if at > position:
            st.violate(
                HASH_CHAIN,
                [position, at],
                f"subscriber {name!r} processed up to position {at} but the log ends at {position}: "
                "events were removed from its end",
            )
    st.violations.sort(key=lambda v: (v.positions[0] if v.positions else 0, v.rule))
    return AuditReport(events=count, head=position, rules_checked=list(RULES), violations=st.violations)


def audit_log(
    store: EventStore, progress: Callable[[int], None] | None = None, payloads: PayloadPlane | None = None
) -> AuditReport:
    """Replays the whole log through every rule (docs/events.md, Invariants).  With `payloads` (the
    plane the log's writers used: `eventstore.payload_stores.payload_plane`; `ledger audit` always
    gives it), it then reads back every payload the events claim and every row of the log's blob
    table against its digest, and asks the database for its own integrity check."""
    facts = PayloadFacts() if payloads is not None else None
    report = audit_events(
        store.read_all(), list_checkpoints(store), subscriber_positions(store), progress, facts
    )
    if payloads is None or facts is None:
        return report
    summary = PayloadAuditSummary()
    found: list[Violation] = []

    def violate(rule: str, positions: list[int], message: str) -> None:
        shown = sorted({p for p in positions if p > 0})[:_MAX_LISTED]
        found.append(Violation(rule=rule, positions=shown, message=message))

    check_database(store, violate, summary)
    check_payloads(facts, payloads, violate, summary)
    check_log_blobs(store, facts, violate, summary)
    violations = sorted(
        report.violations + found, key=lambda v: (v.positions[0] if v.positions else 0, v.rule)
    )
    return AuditReport(
        events=report.events,
        head=report.head,
        rules_checked=[*report.rules_checked, *PAYLOAD_RULES],
        violations=violations,
        payloads=summary,
    )


def _check_digests(
    st: AuditState, stored: list[StoredCheckpoint], block_position: int, block_digest: str, digest: str
) -> None:
    seen: set[str] = set()
    for c in stored:
        if c.log_digest in seen:  # the projections checkpointed together share one digest
            continue
        seen.add(c.log_digest)
        try:
            expected = StoredDigest.decode(c.log_digest)
        except ValueError:
            st.violate(
                HASH_CHAIN,
                [c.position],
                f"the {c.projection} checkpoint at {c.position} has no readable digest",
            )
            continue
        if expected.block != BLOCK or expected.block_position != block_position:
            st.violate(
                HASH_CHAIN,
                [c.position],
                f"the {c.projection} checkpoint at {c.position} used digest blocks of {expected.block}; "
                f"this auditor uses {BLOCK}",
            )
        elif expected.digest != digest or expected.block_digest != block_digest:
            st.violate(
                HASH_CHAIN,
                [c.position],
                f"the log up to position {c.position} no longer matches the digest its {c.projection} checkpoint "
                "recorded: a row before it was removed or altered",
            )


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
