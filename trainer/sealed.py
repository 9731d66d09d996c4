"""A sealed group as training takes it: handed out as it seals, its payloads read (each sibling's reply
and token records by their claims, checked against them), and claimed for a training step.
`RolloutCoordinator.sealed_groups` and `LedgerGym` read through here."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from eventstore.events import Event, GroupClaimedForTraining
from payloads import PayloadClaim
from payloads.token_arrays import TokenArrays, decode_payload
from projections.ledger import GroupState, LedgerState
from protocol import mutants
from protocol.streams import group_stream
from protocol.wire import AttemptRef
from trainer.errors import AlreadyClaimed, ClaimWhilePrepared, NotSealed, UnknownGroup
from trainer.gate import Gate
from trainer.groups import Groups
from trainer.journal import Journal
from trainer.payload_io import PayloadIO


@dataclass(frozen=True)
class SealedGroup:
    """What training consumes: the group and, per sibling, the sealed attempt, its reward, its reply
    and its token records.

    `replies` are the agents' `/run` replies (`response`, `reward`, the task fields) and `tokens` the
    token records as arrays (`payloads.token_arrays.TokenArrays`: views of the stored payload, no
    per-token Python object), both read back from the payload plane by their claims; `sealed_groups`
    fills them in, `sealed_unclaimed` does not (it does no I/O).  An attempt sealed before replies
    were kept has None there.  A reply that carried its records' token arrays (a real Gym agent's) is
    stored and read apart from them (`reply_claims[i].media_type` is `REPLY_APART_MEDIA_TYPE`): its
    arrays are in `tokens[i]`, and `payloads.replies.put_arrays_back(replies[i], tokens[i])` gives the
    agent's reply whole.
    """

    group_id: str
    agent_name: str
    attempts: list[AttemptRef]
    rewards: list[float]
    tokens_digests: list[str]
    reply_digests: list[str] = field(default_factory=list)
    replies: list[dict[str, Any] | None] = field(default_factory=list)
    token_claims: list[PayloadClaim | None] = field(default_factory=list)
    reply_claims: list[PayloadClaim | None] = field(default_factory=list)
    tokens: list[TokenArrays | None] = field(default_factory=list)


def sealed_of(group: GroupState) -> SealedGroup:
    """The sealed group as the log holds it (claims and digests; no payload read)."""
    siblings = sorted(group.siblings.values(), key=lambda s: s.generation_index)
    refs, rewards, digests, replies = [], [], [], []
    token_claims: list[PayloadClaim | None] = []
    reply_claims: list[PayloadClaim | None] = []
    for s in siblings:
        index = s.sealed_attempt if s.sealed_attempt is not None else s.current_attempt
        attempt = s.attempts[index]
        refs.append(AttemptRef(rollout_id=s.rollout_id, attempt_index=index))
        rewards.append(float(s.reward if s.reward is not None else 0.0))
        receipt = attempt.rollout_receipt
        digests.append(receipt.tokens_digest if receipt else "")
        replies.append(attempt.reply_digest or "")
        token_claims.append(receipt.tokens_claim() if receipt else None)
        reply_claims.append(attempt.reply_claim)
    return SealedGroup(
        group.group_id,
        group.agent_name,
        refs,
        rewards,
        digests,
        replies,
        token_claims=token_claims,
        reply_claims=reply_claims,
    )


async def read_payloads(
    payloads: PayloadIO, siblings: Sequence[tuple[PayloadClaim | None, PayloadClaim | None]]
) -> list[tuple[dict[str, Any] | None, TokenArrays | None]]:
    """Each sibling's (reply, token records) read by their (reply claim, token claim): one read per
    store for the whole group, each payload checked against its claim; the arrays are read-only views
    of the bytes read (not copied).  A claim that is None reads as None."""
    claims = [c for pair in siblings for c in pair if c is not None]
    found = await payloads.get_many(claims)
    out: list[tuple[dict[str, Any] | None, TokenArrays | None]] = []
    for reply_claim, tokens_claim in siblings:
        reply = orjson.loads(found[reply_claim.digest]) if reply_claim is not None else None
        tokens = (
            decode_payload(
                found[tokens_claim.digest], tokens_claim.media_type, check_canonical=False, reply=reply
            )
            if tokens_claim is not None
            else None
        )
        out.append((reply, tokens))
    return out


async def with_payloads(payloads: PayloadIO, group: SealedGroup) -> SealedGroup:
    """The group with its siblings' replies and token records read (`read_payloads`)."""
    read = await read_payloads(payloads, list(zip(group.reply_claims, group.token_claims, strict=True)))
    return dataclasses.replace(group, replies=[r for r, _ in read], tokens=[t for _, t in read])


class Training:
    """The hand-out of this trainer's sealed groups and their claims for training."""

    def __init__(self, journal: Journal, groups: Groups, gate: Gate, payloads: PayloadIO) -> None:
        self.journal = journal
        self.groups = groups
        self.gate = gate
        self.payloads = payloads

    def sealed_unclaimed(self) -> list[SealedGroup]:
        return [sealed_of(g) for g in self._unclaimed()]

    def _unclaimed(self) -> list[GroupState]:
        ledger = self.journal.ledger
        groups = ledger.groups
        return [g for g in map(groups.__getitem__, ledger.sealed_unclaimed_ids()) if self.groups.owns(g)]

    async def sealed_groups(self, *, until_idle: bool = True) -> AsyncIterator[SealedGroup]:
        seen: set[str] = set()
        while True:
            # Each group's SealedGroup is built once, when it is handed out: groups handed out and not
            # yet claimed (a training step collecting its batch) are passed over at every batch.
            for group in self._unclaimed():
                if group.group_id not in seen:
                    seen.add(group.group_id)
                    yield await with_payloads(self.payloads, sealed_of(group))
            if self.journal.fenced is not None:
                raise self.journal.fenced
            if self.journal.stopped is not None:
                raise self.journal.stopped
            if until_idle and self.groups.idle() and all(g.group_id in seen for g in self._unclaimed()):
                # Groups on an agent that refused this trainer wait open, undriven: said, not waited on.
                stuck = self.groups.stuck_on_refusal()
                if stuck is not None:
                    raise stuck
                return
            await self.journal.wait_changed(0.5)

    async def claim(self, group_id: str, train_step: int | None, call_id: str | None) -> None:
        def build(ledger: LedgerState) -> list[Event]:
            # Checked when the append is built: the gate is raised before CheckpointPrepareStarted is
            # queued and lowered after the decision is written, so no claim lands between the two.
            held = None if mutants.active("claim_while_prepared") else self.gate.checkpoint
            if held is not None:
                raise ClaimWhilePrepared(
                    f"group {group_id!r} cannot be claimed while checkpoint {held!r} is prepared and "
                    "undecided: claim it after the commit or abort"
                )
            group = ledger.groups.get(group_id)
            if group is None:
                if group_id in ledger.archived:
                    raise AlreadyClaimed(f"group {group_id!r} was trained on and archived")
                raise UnknownGroup(f"unknown group {group_id!r}")
            if not self.groups.owns(group):
                raise UnknownGroup(
                    f"group {group_id!r} belongs to trainer {group.trainer_id!r}, not this one"
                )
            if group.status != "sealed":
                raise NotSealed(f"group {group_id!r} is {group.status}, not sealed")
            if group.claims:
                raise AlreadyClaimed(f"group {group_id!r} was claimed for step {group.claims[-1].train_step}")
            return [GroupClaimedForTraining(group_id=group_id, train_step=train_step, call_id=call_id)]

        await self.journal.append(group_stream(group_id), build)
