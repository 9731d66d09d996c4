"""The operator's retention at the end of a schedule, and what the checker asks of it.

Once every trainer of a schedule is done, an operator prunes the payloads of the groups done for good
and collects those no event needs, as `ledger payloads prune` and `ledger payloads collect` do (the
same pure decisions, `projections.retention`, with no grace: nothing is being put any more).  The
checker then asks that no group still in play lost a payload: one the log may still need (a restore
to a committed checkpoint, an unpaid debt, a group no cut covers) must be there to read.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Sequence

from eventstore import EventStore, RecordedEvent, open_store
from eventstore.payload_stores import payload_plane
from projections.ledger import LedgerState
from projections.retention import collectable, fold_refs, prune_plan, pruned_events
from projections.runner import rebuild
from protocol.streams import RETENTION_STREAM, group_of_stream


def prune_and_collect(url: str) -> tuple[int, int]:
    """Prunes the done groups' payloads (`PayloadsPruned` first, then the deletes) and collects what no
    event needs; returns (pruned, collected)."""
    store = open_store(url)
    try:
        seen = store.stream_version(RETENTION_STREAM)
        ledger: LedgerState = rebuild(store).state("ledger")
        target = payload_plane(store).default
        refs = fold_refs(store.read_all())
        stored = {p.digest: p for p in target.scan()}
        done = {g: a.last_position for g, a in ledger.archived.items()}
        # No logprob worker scores an exploration's log: the operator prunes with `--unscored`.
        plan = prune_plan(refs, done, stored, target.name, time.time(), grace_s=0.0, unscored_too=True)
        pruned = 0
        if plan.groups:
            store.append(
                RETENTION_STREAM,
                list(pruned_events(plan, target.name)),
                seen,
                metadata={"writer": "retention"},
            )
            pruned = target.delete(plan.digests)
        gone = collectable(fold_refs(store.read_all()), target.scan(), time.time(), grace_s=0.0)
        return pruned, target.delete(gone)
    finally:
        store.close()


def live_payloads_gone(store: EventStore, events: Sequence[RecordedEvent], groups: set[str]) -> list[str]:
    """Of `groups`, each whose payloads are not all stored although it is not done for good.

    Done for good, as the checker reads the log (a superset of what the ledger archives, so an
    unmutated prune is never called wrong): some committed checkpoint of the group's trainer cuts at or
    after every event the group had when the trainer's next checkpoint committed.  Events after that
    (the release of a result an agent that lost its state ran again: a retire owed, its receipt's ACK)
    need none of the group's payloads.  A group the ledger could not have archived so keeps every
    payload its events claim."""
    trainer_of: dict[str, str | None] = {}  # group -> its trainer; checkpoint -> the trainer that prepared it
    positions: dict[str, list[int]] = {}  # group -> its events' positions, in log order
    # trainer -> (the commit's own position, its cut) of each of its commits, in log order
    commits: dict[str | None, list[tuple[int, int]]] = {}
    for e in events:
        gid = group_of_stream(e.stream_id)
        if gid is not None:
            positions.setdefault(gid, []).append(e.position)
        if e.type == "GroupReserved":
            trainer_of.setdefault(e.data["group_id"], e.data.get("trainer_id"))
        elif e.type == "CheckpointPrepareStarted":
            trainer_of.setdefault(e.data["checkpoint_id"], e.data.get("trainer_id"))
        elif e.type == "CheckpointCommitted":
            trainer = trainer_of.get(e.data["checkpoint_id"], e.data.get("trainer_id"))
            commits.setdefault(trainer, []).append((e.position, e.data["cut_position"]))

    def done(gid: str) -> bool:
        own = commits.get(trainer_of.get(gid), [])
        seen = positions.get(gid, [])
        for (_, cut), (committed_at, _) in itertools.pairwise(own):
            before = seen[: bisect.bisect_left(seen, committed_at)]
            if before and before[-1] <= cut:
                return True
        return False

    refs = fold_refs(events)
    plane = payload_plane(store)
    found = []
    for gid in sorted(g for g in groups if not done(g)):
        digests = sorted(refs.by_group.get(gid, ()))
        by_store: dict[str, list[str]] = {}
        for d in digests:
            by_store.setdefault(refs.claims[d].store, []).append(d)
        missing = sum(
            len(set(ds) - plane.stores[name].contains(ds))
            for name, ds in by_store.items()
            if name in plane.stores
        )
        if missing:
            found.append(
                f"{missing} of the {len(digests)} payload(s) of live group {gid} are gone: pruned or collected "
                "while the group is not done for good"
            )
    return found
