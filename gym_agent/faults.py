"""Injected faults of the reference agent: per try, as seeded random rates, or a crash countdown."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

from participant import Hooks
from protocol.wire import AttemptFault, CrashAfter, FaultRates, RateFaults, RunRequest

log = logging.getLogger("gym_agent")

CRASH_EXIT_CODE: Final = 70

FaultRequest = AttemptFault | RateFaults | CrashAfter


@dataclass(frozen=True)
class ResolvedFault:
    """What one try will suffer, fixed when the try starts."""

    drop_reply: bool = False
    fail: bool = False
    delay_s: float = 0.0
    hang: bool = False
    hang_at_turn: int | None = None


NO_FAULT = ResolvedFault()


def _uniform(seed: int, kind: str, rollout_id: str, attempt_index: int) -> float:
    """A draw in [0, 1) that depends only on its inputs, so a rate fault hits the same tries in every run."""
    digest = hashlib.sha256(f"{seed}|{kind}|{rollout_id}|{attempt_index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


class FaultTable:
    def __init__(self) -> None:
        self._per_attempt: dict[tuple[str, int], AttemptFault] = {}
        self._rates = FaultRates()
        self._rate_seed = 0
        self._crash_remaining: int | None = None

    def apply(self, request: FaultRequest) -> None:
        if isinstance(request, AttemptFault):
            key = (request.rollout_id, request.attempt_index)
            if request.drop_reply or request.fail or request.hang or request.delay_s or request.hang_at_turn:
                self._per_attempt[key] = request
            else:
                self._per_attempt.pop(key, None)  # an all-clear body removes the entry
        elif isinstance(request, RateFaults):
            self._rates, self._rate_seed = request.rates, request.seed
        else:
            self._crash_remaining = request.crash_after

    def for_attempt(self, rollout_id: str, attempt_index: int) -> ResolvedFault:
        explicit = self._per_attempt.get((rollout_id, attempt_index))
        if explicit is not None:
            return ResolvedFault(
                drop_reply=explicit.drop_reply,
                fail=explicit.fail,
                delay_s=explicit.delay_s,
                hang=explicit.hang,
                hang_at_turn=explicit.hang_at_turn,
            )
        rates = self._rates
        return ResolvedFault(
            drop_reply=_uniform(self._rate_seed, "drop_reply", rollout_id, attempt_index) < rates.drop_reply,
            fail=_uniform(self._rate_seed, "fail", rollout_id, attempt_index) < rates.fail,
            hang=_uniform(self._rate_seed, "hang", rollout_id, attempt_index) < rates.hang,
        )

    @property
    def crash_pending_now(self) -> bool:
        """`crash_after: 0` means: exit at once."""
        return self._crash_remaining == 0

    def count_completion(self) -> bool:
        """Counts one completion; True when the process must exit now."""
        if self._crash_remaining is None:
            return False
        self._crash_remaining -= 1
        return self._crash_remaining <= 0


class DroppedReply(Response):
    """The drop_reply fault: announce the whole reply, send half of it, and hang up.

    Returning without finishing the body makes uvicorn close the connection, so the client sees a
    broken connection (not a short 200) while the try stays COMPLETED with its reply stored.
    """

    def __init__(self, reply: dict[str, Any]) -> None:
        super().__init__(content=json.dumps(reply).encode(), media_type="application/json")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        await send(
            {"type": "http.response.body", "body": self.body[: len(self.body) // 2], "more_body": True}
        )


def _exit_process() -> None:
    log.error("crash_after fault: exiting the process now (stored replies are lost)")
    logging.shutdown()
    os._exit(CRASH_EXIT_CODE)


class FaultInjector(Hooks):
    """The reference agent's faults through the participant's extension points: a try's fault is
    fixed when it starts, fail/hang/delay act inside the episode, drop_reply on its live delivery,
    crash_after after a completion is durable."""

    def __init__(self, crash: Callable[[], None] = _exit_process) -> None:
        self.table = FaultTable()
        self._crash = crash
        self._resolved: dict[tuple[str, int], ResolvedFault] = {}

    def apply(self, request: FaultRequest) -> None:
        self.table.apply(request)
        if isinstance(request, CrashAfter) and request.crash_after == 0:
            # Give the 200 answer a moment to leave before the process goes away.
            asyncio.get_running_loop().call_later(0.05, self._crash)

    def started(self, request: RunRequest) -> None:
        fault = self.table.for_attempt(request.rollout_id, request.attempt_index)
        if fault != NO_FAULT:  # only faulty tries are remembered
            self._resolved[(request.rollout_id, request.attempt_index)] = fault

    def fault_of(self, request: RunRequest) -> ResolvedFault:
        return self._resolved.get((request.rollout_id, request.attempt_index), NO_FAULT)

    def completed(self, request: RunRequest) -> None:
        if self.table.count_completion():
            self._crash()

    def deliver(self, request: RunRequest, reply: dict[str, Any]) -> Response | None:
        fault = self._resolved.pop((request.rollout_id, request.attempt_index), NO_FAULT)
        if fault.drop_reply:
            log.info("drop_reply fault: breaking off the reply of %s", request.rollout_id)
            return DroppedReply(reply)
        return None
