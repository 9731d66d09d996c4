"""The coordinator's settings: retry budgets, deadlines and what a checkpoint may do to an attempt.
One frozen value, handed to every part that needs it."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from protocol.retry import RetryPolicy
from trainer.core.attempt import RETIRE_POLICY
from trainer.core.debt import ACK_POLICY
from trainer.core.retire_debt import RETIRE_OWED_POLICY

# The trainer's log: every part writes to it (docs/metrics.md, what is logged).
log = logging.getLogger("trainer")


@dataclass(frozen=True)
class Settings:
    rollout_timeout_s: float = 600.0
    prepare_timeout_s: float = 300.0
    max_tries: int = 4
    max_infra_failures: int = 4
    max_data_failures: int = 4
    # A reply with `mask_sample` set is a result like any other (sealed, its mask recorded and passed
    # on to training); True makes it a failed attempt instead, replaced within the data budget.
    mask_sample_retries: bool = False
    # An attempt that reports no progress of its own for this long (and STALL_BEATS of its agent's
    # heartbeat intervals) is stuck inside a model call: a prepare retires it (trainer.core.blocking).
    park_grace_s: float = 1.0
    # Attempts one rollout may lose to checkpoints' last resort; past it a prepare waits for its attempt.
    max_checkpoint_retires: int = 1
    # A prepare asks each agent that can to carry its finished, unACKed attempts across the checkpoint
    # (answer `prepared` once nothing runs) instead of waiting until the trainer has taken them in.
    carry_completed: bool = True
    # Server-side wait of one prepare call before it answers 409 and the coordinator acts on it.
    prepare_poll_s: float = 0.5
    adopt_timeout_s: float = 60.0
    # Several trainers may share one log; each owns the groups and checkpoints it started.
    trainer_id: str | None = None
    # How often each agent's checkpoint phase is compared with the log (0: only at recovery).
    reconcile_every_s: float = 5.0
    # Transport failures of one attempt's retire/adopt calls before it is declared lost.
    retire_policy: RetryPolicy = RETIRE_POLICY
    # Transport failures of one agent's /acknowledge before it is reported stuck (then retried at the cap).
    ack_policy: RetryPolicy = ACK_POLICY
    # Failures of one agent's owed retires (attempts declared lost there) before it is reported stuck
    # (then called at the cap).
    retire_owed_policy: RetryPolicy = RETIRE_OWED_POLICY
