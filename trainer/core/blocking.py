"""A prepare's blocking attempts: wait for each, or retire it and say why (no I/O).

A checkpoint waits for the model calls in progress to reach their boundary, within its prepare
deadline.  Whether an attempt is stuck is judged from its own progress as its agent reports it
(`protocol.wire.AttemptProgress`: a boundary, a token record, a heartbeat of its runner), never from
other attempts:

    an attempt whose agent promised to report progress every `heartbeat_s`, and that went STALL_BEATS
    of them without any (and at least park_grace_s)                        -> retire, `stalled`
    any other attempt (progressing, or its agent promises nothing)            -> wait
    ... until `last_resort_s` before the prepare deadline: every attempt still blocking is retired so the
    checkpoint can pass (`checkpoint`), unless one of them is protected    -> then wait on, retire none

An attempt is protected when its rollout already lost `max_checkpoint_retires` attempts to checkpoints
(its sibling in sibling mode, its group's rounds in prompt_group mode: `checkpoint_losses`): the
checkpoint waits for it, and aborts at its deadline if it must, rather than cancel it again.  Retiring
the others then would throw their work away for a checkpoint that fails anyway.  So every rollout
makes progress however often the trainer checkpoints.  A `stalled` attempt is stuck whatever the
checkpoint does (its rollout deadline would retire it too), so it is not bounded by this rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from eventstore.events import RetireCause

# An attempt is stalled after this many of its agent's heartbeat intervals without progress.
STALL_BEATS = 4
# Time before the prepare deadline at which the attempts still blocking are retired (the last resort):
# enough for their retires, the ACKs they lead to and one more prepare call.
LAST_RESORT_S = 5.0


@dataclass(frozen=True)
class Blocking:
    """One try the agent's prepare answer names as still on its way to a boundary."""

    rollout_id: str
    attempt_index: int
    # Seconds since its last progress, as its agent reports it; None when the agent reports none.
    since_progress_s: float | None
    # Attempts its rollout already lost to checkpoints (the log's count).
    checkpoint_losses: int


@dataclass(frozen=True)
class Retire:
    rollout_id: str
    attempt_index: int
    cause: RetireCause
    reason: str


@dataclass(frozen=True)
class Verdict:
    retire: tuple[Retire, ...] = ()
    # Attempts the last resort may not retire (their rollouts lost their share to checkpoints already).
    protected: tuple[tuple[str, int], ...] = ()


def last_resort_s(prepare_timeout_s: float) -> float:
    """How long before the prepare deadline the last resort comes: LAST_RESORT_S, or a quarter of a
    shorter prepare timeout."""
    return min(LAST_RESORT_S, prepare_timeout_s / 4)


def stall_after_s(heartbeat_s: float | None, park_grace_s: float) -> float | None:
    """Seconds without progress of its own after which an attempt is stuck; None when its agent makes no
    promise to report progress (its attempts are waited for until the last resort)."""
    if heartbeat_s is None:
        return None
    return max(park_grace_s, STALL_BEATS * heartbeat_s)


def judge(
    blocking: Sequence[Blocking],
    *,
    heartbeat_s: float | None,
    park_grace_s: float,
    left_s: float,
    last_resort_at_s: float,
    max_checkpoint_retires: int,
    checkpoint_id: str,
) -> Verdict:
    """What to do about the attempts blocking one agent's prepare, `left_s` before its deadline."""
    stall = stall_after_s(heartbeat_s, park_grace_s)
    stalled = [
        b
        for b in blocking
        if stall is not None and b.since_progress_s is not None and b.since_progress_s >= stall
    ]
    retire = [
        Retire(
            b.rollout_id,
            b.attempt_index,
            "stalled",
            f"stalled: no progress of its own for {b.since_progress_s:.1f} s (its agent reports "
            f"progress every {heartbeat_s} s) while checkpoint {checkpoint_id} waited",
        )
        for b in stalled
    ]
    rest = [b for b in blocking if b not in stalled]
    protected = tuple(
        (b.rollout_id, b.attempt_index) for b in rest if b.checkpoint_losses >= max_checkpoint_retires
    )
    if rest and left_s <= last_resort_at_s and not protected:
        retire += [
            Retire(
                b.rollout_id,
                b.attempt_index,
                "checkpoint",
                f"retired for checkpoint {checkpoint_id}: still short of a boundary {max(0.0, left_s):.1f} s "
                "before its prepare deadline (the last resort)",
            )
            for b in rest
        ]
    return Verdict(tuple(retire), protected)
