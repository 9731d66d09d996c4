"""Which payloads the log still needs: retention of done groups' payloads, collection of unclaimed ones.

Two pure decisions over what the log claims (`PayloadRefs`, folded from the events) and what a store
lists (`StoredPayload`); `ledger payloads prune` and `ledger payloads collect` perform them.

- `prune_plan`: the payloads of groups done for good (the ledger's archived groups: sealed and claimed
  for training, or dead-lettered, every debt paid, behind a committed checkpoint of their trainer's, so
  no restore can bring them back into play) that no other group still claims, and whose sealed tries
  all have their logprob result in the log (`LogprobsComputed` or `LogprobsRefused`, under any policy
  version): a try the logprob queue has not scored yet needs its token records, so its group waits
  (unless the caller says no worker scores this log).  The command appends
  `PayloadsPruned` first and deletes after: a claimed payload is absent only once the log says it was
  pruned, so the audit tells pruned (accepted) from missing (a violation).  Only payloads the store
  holds are named: one already gone stays missing, never excused as pruned.
- `collectable`: payloads a store holds that no event needs (a put whose append never came: the
  process died between the two, or the append was refused; and an interrupted prune's leftovers).

Both spare every payload put within `grace_s` (a put of bytes already stored renews their time, see
`PayloadStore.put_many`): the order rule puts a payload before the append that claims it, so a payload
put a moment ago may be claimed a moment later, and a claim in the log must never lose its payload.
`grace_s` must outlast any put-to-append window (the coordinator's outage budget, 30 s, is the
longest); the commands default to an hour.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

from eventstore import RecordedEvent
from eventstore.events import Event, LogprobsComputed, LogprobsRefused, PayloadsPruned, SiblingSealed
from payloads import PayloadClaim, StoredPayload
from projections.payload_audit import CLAIMS_OF
from protocol import mutants
from protocol.streams import LOGPROBS_STREAM_PREFIX, group_of_stream

DEFAULT_GRACE_S: Final = 3600.0
# Digests per `PayloadsPruned` (one event stays well under the log's row size).
PRUNED_PER_EVENT: Final = 2000


def _group_of(stream_id: str) -> str | None:
    """The group whose events claim on `stream_id`: its group stream or its logprobs stream."""
    if stream_id.startswith(LOGPROBS_STREAM_PREFIX):
        return stream_id[len(LOGPROBS_STREAM_PREFIX) :]
    return group_of_stream(stream_id)


@dataclass(slots=True)
class PayloadRefs:
    """Every payload the log claims, by the group whose events claim it, and what retention pruned."""

    position: int = 0
    by_group: dict[str, set[str]] = field(default_factory=dict)
    # digest -> its latest claim, and that claim's position
    claims: dict[str, PayloadClaim] = field(default_factory=dict)
    last_claimed: dict[str, int] = field(default_factory=dict)
    # digests claimed outside any group's streams: never pruned
    ungrouped: set[str] = field(default_factory=set)
    # digest -> the position of the `PayloadsPruned` that named it
    pruned: dict[str, int] = field(default_factory=dict)
    pruned_groups: set[str] = field(default_factory=set)
    # group -> its sealed tries ("rollout_id/attempt_index") with no logprob result in the log yet
    unscored: dict[str, set[str]] = field(default_factory=dict)

    def see(self, position: int, stream_id: str, decoded: Event) -> None:
        self.position = position
        if isinstance(decoded, PayloadsPruned):
            for digest in decoded.digests:
                self.pruned[digest] = position
            self.pruned_groups.update(decoded.groups)
            return
        if isinstance(decoded, (SiblingSealed, LogprobsComputed, LogprobsRefused)):
            self._scoring(stream_id, decoded)
        claimed = CLAIMS_OF.get(decoded.__class__)
        if claimed is None:
            return
        group = _group_of(stream_id)
        for claim in claimed(decoded):
            self.claims[claim.digest] = claim
            self.last_claimed[claim.digest] = position
            if group is None:
                self.ungrouped.add(claim.digest)
            else:
                self.by_group.setdefault(group, set()).add(claim.digest)

    def _scoring(self, stream_id: str, decoded: SiblingSealed | LogprobsComputed | LogprobsRefused) -> None:
        group = _group_of(stream_id)
        if group is None:
            return
        key = f"{decoded.rollout_id}/{decoded.attempt_index}"
        if isinstance(decoded, SiblingSealed):
            self.unscored.setdefault(group, set()).add(key)
            return
        waiting = self.unscored.get(group)
        if waiting is not None:
            waiting.discard(key)
            if not waiting:
                del self.unscored[group]

    def awaiting_scoring(self, group_id: str) -> bool:
        """Whether a sealed try of the group has no logprob result in the log yet."""
        return bool(self.unscored.get(group_id))

    def is_pruned(self, digest: str) -> bool:
        """Pruned after its latest claim (a claim of the same bytes after a prune needs them again)."""
        return self.pruned.get(digest, -1) > self.last_claimed.get(digest, -1)

    def needed(self) -> set[str]:
        """Digests some event claims and retention has not pruned since."""
        return {d for d in self.last_claimed if not self.is_pruned(d)}


def fold_refs(events: Iterable[RecordedEvent]) -> PayloadRefs:
    refs = PayloadRefs()
    for event in events:
        refs.see(event.position, event.stream_id, event.decode())
    return refs


def collectable(
    refs: PayloadRefs, stored: Iterable[StoredPayload], now: float, grace_s: float = DEFAULT_GRACE_S
) -> list[str]:
    """Stored payloads no event needs, put more than `grace_s` ago, in digest order."""
    needed = refs.needed()
    return sorted(p.digest for p in stored if p.digest not in needed and now - p.stored_at > grace_s)


@dataclass(frozen=True, slots=True)
class PrunePlan:
    groups: list[str]  # oldest first
    digests: list[str]  # sorted
    bytes: int  # what the store lists for them
    deferred: list[str]  # done groups left for a later prune (a payload of theirs put within the grace)
    # done groups kept while a sealed try of theirs awaits its logprob result (oldest first)
    awaiting_scoring: list[str] = field(default_factory=list)


def prune_plan(
    refs: PayloadRefs,
    done: Mapping[str, int],
    stored: Mapping[str, StoredPayload],
    store_name: str,
    now: float,
    *,
    grace_s: float = DEFAULT_GRACE_S,
    keep_newest: int = 0,
    unscored_too: bool = False,
) -> PrunePlan:
    """The payloads in `store_name` (listed in `stored`) of the groups done for good (`done`: group ->
    its last position), but the newest `keep_newest` of them, any group with a payload put within
    `grace_s`, any group with a sealed try the logprob queue has not scored (unless `unscored_too`: no
    worker scores this log), and any payload another group or no group still claims."""
    if mutants.active("payload_pruned_while_claimed"):
        done = {g: 0 for g in refs.by_group}
    candidates = sorted(
        (g for g in done if g not in refs.pruned_groups and refs.by_group.get(g)), key=lambda g: (done[g], g)
    )
    if keep_newest:
        candidates = candidates[: max(0, len(candidates) - keep_newest)]
    scoring = [] if unscored_too else [g for g in candidates if refs.awaiting_scoring(g)]
    if scoring:
        kept = set(scoring)
        candidates = [g for g in candidates if g not in kept]
    deferred = [
        g
        for g in candidates
        if any(d in stored and now - stored[d].stored_at <= grace_s for d in refs.by_group[g])
    ]
    waiting = set(deferred)
    chosen = [g for g in candidates if g not in waiting]
    chosen_set = set(chosen)
    still_needed = set(refs.ungrouped)
    for group, claimed in refs.by_group.items():
        if group not in chosen_set:
            still_needed |= claimed
    digests = sorted(
        {
            d
            for g in chosen
            for d in refs.by_group[g]
            if d in stored
            and refs.claims[d].store == store_name
            and d not in still_needed
            and not refs.is_pruned(d)
        }
    )
    return PrunePlan(chosen, digests, sum(stored[d].size for d in digests), deferred, scoring)


def pruned_events(plan: PrunePlan, store_name: str) -> list[PayloadsPruned]:
    """The plan as `PayloadsPruned` events of at most `PRUNED_PER_EVENT` digests, the groups in the first."""
    chunks = [plan.digests[i : i + PRUNED_PER_EVENT] for i in range(0, len(plan.digests), PRUNED_PER_EVENT)]
    return [
        PayloadsPruned(store=store_name, groups=plan.groups if i == 0 else [], digests=chunk)
        for i, chunk in enumerate(chunks or [[]])
    ]


__all__ = [
    "DEFAULT_GRACE_S",
    "PRUNED_PER_EVENT",
    "PayloadRefs",
    "PrunePlan",
    "collectable",
    "fold_refs",
    "prune_plan",
    "pruned_events",
]
