"""A random but legal trainer: drives the coordinator's state machine (docs/protocol.md) into a log.

Every step picks one transition the protocol allows from the current state:
reserve, dispatch, reply (sealed, held or masked), fail then retire (cancelled
or completed_unacknowledged, then adopted), ACK or lose a debt to an agent
restart, abandon and rerun a prompt group, dead-letter past the budget,
claim, checkpoint (committed or aborted), restore.  A log written this way
must pass every audit rule, and every projection of it must rebuild to the
same state from any offset and any checkpoint.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from eventstore.events import AckAccepted, Event, GroupAbandoned, ReplacementMinted
from protocol.wire import AttemptRef
from tests.projections.builder import LogBuilder


@dataclass
class Sib:
    index: int
    attempt: int = 0
    phase: str = "minted"  # minted dispatched replied failed sealed held owed(masked) retired

    def rid(self, group_id: str) -> str:
        return f"{group_id}_g{self.index}"


@dataclass
class Grp:
    group_id: str
    mode: str
    max_tries: int
    sibs: list[Sib]
    status: str = "open"  # open sealed dead
    claimed: int | None = None  # position of the standing claim


@dataclass
class Simulator:
    log: LogBuilder
    rng: random.Random
    groups: list[Grp] = field(default_factory=list)
    debts: list[tuple[str, int]] = field(default_factory=list)
    cut: int | None = None
    checkpoint_id: str | None = None
    count: int = 0

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step()

    def step(self) -> None:
        actions = [self.reserve] * (3 if len(self.groups) < 3 else 1)
        open_groups = [g for g in self.groups if g.status == "open"]
        if open_groups:
            actions += [self.advance] * 8
        if self.debts:
            actions += [self.ack] * 3
        if any(g.status == "sealed" and g.claimed is None for g in self.groups):
            actions.append(self.claim)
        actions.append(self.checkpoint)
        if self.rng.random() < 0.3:
            actions.append(self.restore)
        self.rng.choice(actions)()

    # --- groups and tries --------------------------------------------------

    def reserve(self) -> None:
        self.count += 1
        gid = f"p{self.count}"
        mode = self.rng.choice(["sibling", "prompt_group"])
        size = self.rng.randint(1, 3)
        group = Grp(gid, mode, self.rng.randint(1, 3), [Sib(i) for i in range(size)])
        self.log.reserve(gid, size, mode=mode, max_tries=group.max_tries)
        self.log.mint(gid, size)
        self.groups.append(group)

    def advance(self) -> None:
        group = self.rng.choice([g for g in self.groups if g.status == "open"])
        if group.mode == "sibling" and all(s.phase == "sealed" for s in group.sibs):
            self.log.seal_group(group.group_id, {s.index: s.attempt for s in group.sibs})
            group.status = "sealed"
            return
        if group.mode == "prompt_group" and all(s.phase == "held" for s in group.sibs):
            self.log.seal_group(group.group_id, {s.index: s.attempt for s in group.sibs}, held=True)
            group.status = "sealed"
            for s in group.sibs:
                s.phase = "sealed"
            return
        if group.mode == "prompt_group" and any(s.phase in ("failed_settled", "masked") for s in group.sibs):
            self.abandon(group)
            return
        movable = [
            s for s in group.sibs if s.phase in ("minted", "dispatched", "retired", "masked", "failed")
        ]
        if not movable:
            return
        self.move(group, self.rng.choice(movable))

    def move(self, group: Grp, sib: Sib) -> None:
        rid, a = sib.rid(group.group_id), sib.attempt
        if sib.phase == "minted":
            self.log.dispatch(rid, a)
            sib.phase = "dispatched"
        elif sib.phase == "dispatched":
            roll = self.rng.random()
            if roll < 0.6:
                self.finish(group, sib, masked=self.rng.random() < 0.2)
            else:
                self.log.fail(rid, a)
                sib.phase = "failed"
        elif sib.phase == "failed":
            if self.rng.random() < 0.5:
                self.log.retire(rid, a, "completed_unacknowledged")
                self.log.adopt(rid, a)
                self.finish(group, sib, masked=False)
            else:
                self.log.retire(rid, a, self.rng.choice(["cancelled", "tombstoned"]))
                sib.phase = "retired" if group.mode == "sibling" else "failed_settled"
        elif sib.phase in ("retired", "masked") and group.mode == "sibling":
            self.replace_sibling(group, sib)

    def finish(self, group: Grp, sib: Sib, masked: bool) -> None:
        rid, a = sib.rid(group.group_id), sib.attempt
        self.log.reply(rid, a, mask=masked)
        if masked:
            self.log.owe(rid, a)
            sib.phase = "masked"
        elif group.mode == "sibling":
            self.log.seal(rid, a)
            sib.phase = "sealed"
        else:
            self.log.hold(rid, a)
            sib.phase = "held"
        self.debts.append((rid, a))

    def replace_sibling(self, group: Grp, sib: Sib) -> None:
        if sib.attempt + 1 >= group.max_tries:
            self.dead_letter(group)
            return
        sib.attempt += 1
        self.log.replace(sib.rid(group.group_id), sib.attempt, reason=sib.phase)
        sib.phase = "minted"

    def abandon(self, group: Grp) -> None:
        gid = group.group_id
        for s in group.sibs:  # settle what the agent may hold before the round is thrown away
            rid, a = s.rid(gid), s.attempt
            if s.phase == "dispatched":
                self.log.retire(rid, a, "cancelled")
            elif s.phase == "failed":
                self.log.retire(rid, a, "tombstoned")
        refs = [AttemptRef(rollout_id=s.rid(gid), attempt_index=s.attempt) for s in group.sibs]
        if group.sibs[0].attempt + 1 >= group.max_tries:
            self.log.abandon(gid, {s.index: s.attempt for s in group.sibs})
            self.dead_letter(group)
            return
        events: list[Event] = [GroupAbandoned(group_id=gid, reason="a sibling failed", attempts=refs)]
        for s in group.sibs:
            s.attempt += 1
            events.append(
                ReplacementMinted(
                    rollout_id=s.rid(gid),
                    generation_index=s.index,
                    attempt_index=s.attempt,
                    replaces=s.attempt - 1,
                    reason="group abandoned",
                )
            )
            s.phase = "minted"
        self.log.group(gid, events)

    def dead_letter(self, group: Grp) -> None:
        for s in group.sibs:  # nothing of a dead group keeps running at the agent
            if s.phase in ("dispatched", "failed"):
                self.log.retire(s.rid(group.group_id), s.attempt, "cancelled")
                s.phase = "retired"
        self.log.dead_letter(group.group_id, {s.index: s.attempt for s in group.sibs})
        group.status = "dead"

    # --- debts, claims, checkpoints, restores ---------------------------------------------

    def ack(self) -> None:
        rid, a = self.debts.pop(self.rng.randrange(len(self.debts)))
        if self.rng.random() < 0.1:
            self.log.reject(rid, a, error="unknown_execution")
        elif self.rng.random() < 0.3:  # the ACK relay's own stream
            self.log.append("acks-agent-a", [AckAccepted(rollout_id=rid, attempt_index=a, idempotent=False)])
        else:
            self.log.ack(rid, a)

    def claim(self) -> None:
        group = self.rng.choice([g for g in self.groups if g.status == "sealed" and g.claimed is None])
        group.claimed = self.log.claim(group.group_id, self.rng.randint(0, 50))[0]

    def checkpoint(self) -> None:
        self.count += 1
        cid = f"c{self.count}"
        self.log.prepare(cid)
        if self.rng.random() < 0.25:
            self.log.abort(cid)
            return
        while self.debts:  # prepare waits until every finished result is ACKed
            self.ack()
        self.cut = self.log.store.head()
        self.checkpoint_id = cid
        self.log.commit(cid, self.cut)
        if self.rng.random() < 0.8:
            self.log.resume(cid)

    def restore(self) -> None:
        cut = self.cut if self.cut is not None else 0
        self.log.restored(self.cut, self.checkpoint_id, {"debts_to_flush": len(self.debts)})
        for g in self.groups:
            if g.claimed is not None and g.claimed > cut:
                g.claimed = None
