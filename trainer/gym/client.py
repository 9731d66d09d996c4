"""The trainer's async client of one Gym agent (`GymClient`), a façade over one private worker per concern.

Two connection pools: `/run` calls are long and many, so they get their own pool and no default
timeout (the trainer's lease deadline governs them); control calls go through a second pool with a 60 s
default timeout, so they never queue behind open runs (docs/protocol.md, Connection pools).  Every reply is checked
against its wire model; every refusal becomes a typed exception from `trainer.gym.errors`.

The pools are `LeanTransport`s (a keep-alive HTTP/1.1 pool whose responses llhttp parses) called through
their `exchange` method: the transport errors are httpx's own, without httpx's client layer per call
(`benchmarks/gym_client.py` measures it against aiohttp's and httpx's clients; `docs/http-client.md`).

The client holds what it knows of its agent (capabilities, reduced mode, the trainer it drives for) and
the pools; the work of each call is done by a private module: the wire (`exchange`, `refusals`,
`answers`), `/run` (`runs`, `completed`), the control calls (`control`) and the checkpoint phases
(`phases`).  Every call goes through `_send` (the token fetch through `_exchange`) on this object.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Self

from pydantic import BaseModel

from payloads.token_arrays import TokenArrays
from protocol.wire import (
    FEATURE_CARRY_COMPLETED,
    FEATURE_CHECKPOINT_PARTICIPATION,
    FEATURE_COMPLETION_IN_RUN,
    TRAINER_HEADER,
    AcknowledgeResult,
    AgentStatus,
    AttemptFault,
    Capabilities,
    CompletionReceipt,
    CrashAfter,
    DriverResponse,
    Health,
    PhaseResponse,
    RateFaults,
    RetireResponse,
    RunReply,
    RunRequest,
)
from trainer.gym import control, phases
from trainer.gym.completed import Completed
from trainer.gym.errors import AgentIdentityError, GymError, NotFoundError
from trainer.gym.exchange import DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_CONTROL_TIMEOUT_S, Exchange
from trainer.gym.reduced import ReducedMode
from trainer.gym.runs import Runs
from trainer.gym.transport import LeanTransport, Reply

log = logging.getLogger("trainer")


class GymClient:
    def __init__(
        self,
        base_url: str,
        agent_name: str,
        *,
        token: str | None = None,
        run_timeout_s: float | None = None,
        control_timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        max_run_connections: int = 1024,
        max_control_connections: int = 16,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._wire = Exchange(
            base_url,
            token=token,
            run_timeout_s=run_timeout_s,
            control_timeout_s=control_timeout_s,
            connect_timeout_s=connect_timeout_s,
            ssl_context=ssl_context,
        )
        self.base_url = self._wire.base_url  # without a trailing slash
        self.agent_name = agent_name
        self.control_timeout_s = control_timeout_s
        verify = self._wire.ssl_context
        self._run = LeanTransport(ssl_context=verify, max_connections=max_run_connections)
        self._runs = Runs(self, max_run_connections)
        self._control = LeanTransport(ssl_context=verify, max_connections=max_control_connections)
        # The checkpoint's phase calls have a pool of their own: a prepare never queues behind the
        # receipts, token records and ACKs of a burst of results (it holds every agent's admission).
        self._phases = LeanTransport(ssl_context=verify, max_connections=phases.PHASE_CONNECTIONS)
        # What the agent said it supports (`connect`); `reduced` is set for a plain Gym agent.
        self.capabilities_seen: Capabilities | None = None
        self.reduced: ReducedMode | None = None
        # One /capabilities call at a time; callers queue in order (their /run calls keep that order).
        self._connecting = asyncio.Lock()
        # The trainer this client drives the agent for (`drive_as`), named on every call that changes
        # what the agent holds; unset, calls are not checked by the agent.
        self._trainer: tuple[tuple[bytes, bytes], ...] = ()

    def __repr__(self) -> str:  # the token stays out of reprs
        return f"GymClient({self.base_url!r}, agent_name={self.agent_name!r})"

    async def aclose(self) -> None:
        await self._run.aclose()
        await self._control.aclose()
        await self._phases.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # -- transport -----------------------------------------------------------------------------------

    async def _send(
        self,
        pool: LeanTransport,
        method: str,
        path: str,
        *,
        body: BaseModel | None = None,
        timeout_s: float | None = None,
        extra_headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> Reply:
        """One call; returns a 200 reply (for `answers.parse`), raises a typed error otherwise.  Every
        call of the client but the token fetch goes through here (tests gate and break calls here)."""
        return await self._exchange(
            pool, method, path, body=body, timeout_s=timeout_s, extra_headers=extra_headers
        )

    async def _exchange(
        self,
        pool: LeanTransport,
        method: str,
        path: str,
        *,
        body: BaseModel | None = None,
        timeout_s: float | None = None,
        extra_headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> Reply:
        """One call; returns a 200 reply whole (headers too), raises a typed error otherwise."""
        # The pool is compared at each call: one put in after construction is the run pool too.
        timeouts = self._wire.timeouts(timeout_s, run_pool=pool is self._run)
        return await self._wire.call(
            pool, method, path, body=body, timeouts=timeouts, extra_headers=extra_headers
        )

    # -- the run pool ----------------------------------------------------------------------------------

    @property
    def runs_waiting(self) -> int:
        """The `/run` calls waiting for a connection of the run pool."""
        return self._runs.waiting

    async def run(
        self,
        request: RunRequest,
        *,
        timeout_s: float | None = None,
        adopt_only: bool = False,
        continue_from: str | None = None,
        on_slot: Callable[[], Awaitable[None]] | None = None,
    ) -> RunReply:
        """`POST /run` (`run_completed`, which see), answered with the reply alone."""
        done = await self.run_completed(
            request,
            timeout_s=timeout_s,
            adopt_only=adopt_only,
            continue_from=continue_from,
            on_slot=on_slot,
            with_completion=False,
        )
        return done.reply

    async def run_completed(
        self,
        request: RunRequest,
        *,
        timeout_s: float | None = None,
        adopt_only: bool = False,
        continue_from: str | None = None,
        on_slot: Callable[[], Awaitable[None]] | None = None,
        with_completion: bool = True,
    ) -> Completed:
        """`POST /run`: blocks until the attempt is done; a re-sent call for the same attempt never reruns it.

        `adopt_only`: the agent replays a stored reply or answers 404, and never starts the attempt.
        `continue_from`: a continuation's digest the new attempt resumes (docs/turns.md); what the agent
        did with it is in the attempt's completion receipt.  A
        plain Gym agent's reply is completed with the attempt's identity (`gym_reply`); in reduced mode
        the trainer keeps it (its receipt and token records are made here) and replays it itself.

        The call first waits for a connection of the run pool (`max_run_connections`; `runs_waiting`
        counts the calls waiting); `on_slot` is awaited once it holds one, right before the request
        goes out: the trainer records the dispatch and starts the attempt's lease there, so an attempt queued in
        this client spends none of it.  `timeout_s` bounds the wait for a connection too.

        `with_completion`: an agent that declares `completion_in_run` is asked (by media type) to
        answer with the attempt's receipt and token records too (`protocol.completion`), so the caller need
        not fetch them; what is missing or unreadable in that answer is left None, to be fetched."""
        return await self._runs.completed(
            request,
            timeout_s=timeout_s,
            adopt_only=adopt_only,
            continue_from=continue_from,
            on_slot=on_slot,
            with_completion=with_completion,
        )

    # -- what the agent supports ------------------------------------------------------------------------

    async def connect(self) -> Capabilities:
        """Asks `/capabilities` once: a participant answers its name and features; a plain Gym agent
        answers 404, and the client drives it in reduced mode (`trainer.gym.reduced`).  Raises
        `AgentIdentityError` when the agent answers with another name than this client's, and the
        call's own error when it gets no answer (it is asked again next time)."""
        if self.capabilities_seen is not None:
            return self.capabilities_seen
        async with self._connecting:
            if self.capabilities_seen is not None:
                return self.capabilities_seen
            try:
                seen = await self.capabilities()
            except NotFoundError:
                log.warning(
                    "agent %s (%s) has no /capabilities: a plain Gym agent, driven in reduced mode "
                    "(no ACK, not in checkpoints)",
                    self.agent_name,
                    self.base_url,
                )
                self.reduced = ReducedMode(self.agent_name)
                seen = self.reduced.capabilities()
            else:
                if seen.agent_name != self.agent_name:
                    raise AgentIdentityError(
                        f"the agent at {self.base_url} is {seen.agent_name!r}, not {self.agent_name!r}: "
                        "fix the agents mapping (its receipts would be owed to the wrong agent)"
                    )
            self.capabilities_seen = seen
            return seen

    async def connect_quietly(self) -> None:
        """`connect`, where only a wrong identity is fatal: an agent away or answering garbage is
        asked again on the next call, and meanwhile treated as a participant (its routes will say)."""
        if self.capabilities_seen is not None:
            return
        try:
            await self.connect()
        except AgentIdentityError:
            raise
        except GymError:
            pass

    @property
    def completion_in_run(self) -> bool:
        """True for an agent that declared it answers `/run` with the receipt and token records."""
        seen = self.capabilities_seen
        return seen is not None and FEATURE_COMPLETION_IN_RUN in seen.features

    @property
    def checkpoint_participant(self) -> bool:
        """False for an agent known to lack the participant routes: checkpoints cannot include it."""
        seen = self.capabilities_seen
        return seen is None or FEATURE_CHECKPOINT_PARTICIPATION in seen.features

    @property
    def carries_completed(self) -> bool:
        """Whether the agent declared it can carry finished, unACKed attempts across a checkpoint (an
        agent not asked yet is not asked to: an older one would refuse the field)."""
        seen = self.capabilities_seen
        return seen is not None and FEATURE_CARRY_COMPLETED in seen.features

    # -- the control pool ------------------------------------------------------------------------------

    async def health(self) -> Health:
        return await control.health(self)

    async def capabilities(self) -> Capabilities:
        return await control.capabilities(self)

    async def status(self) -> AgentStatus:
        return await control.status(self)

    async def completion_receipt(self, rollout_id: str, attempt_index: int) -> CompletionReceipt:
        return await control.completion_receipt(self, rollout_id, attempt_index)

    async def token_capture(self, capture_key: str) -> TokenArrays:
        """The attempt's token records in their canonical binary form, as arrays.  An agent that speaks
        the binary form answers in it (no JSON, no per-token Python object on this side); one that
        does not answers JSON, converted once here."""
        return await control.token_capture(self, capture_key)

    async def acknowledge(self, receipts: Sequence[CompletionReceipt]) -> list[AcknowledgeResult]:
        """ONE `/acknowledge` request carrying every receipt; one result per receipt, in order."""
        return await control.acknowledge(self, receipts)

    async def retire(
        self, rollout_id: str, attempt_index: int, checkpoint_id: str | None = None
    ) -> RetireResponse:
        return await control.retire(self, rollout_id, attempt_index, checkpoint_id)

    # -- the checkpoint phase pool ---------------------------------------------------------------------

    async def prepare(
        self, checkpoint_id: str, timeout_s: float = 300.0, carry: bool = False
    ) -> PhaseResponse:
        """Ready: the answer (phase `prepared`; with `carry`, to an agent that can, the finished
        unACKed attempts it carries in `carried`). Not ready: raises `NotReadyError` listing the attempts to
        ACK/adopt."""
        return await phases.prepare(self, checkpoint_id, timeout_s, carry)

    async def commit(self, checkpoint_id: str) -> PhaseResponse:
        return await phases.phase_call(self, "commit", checkpoint_id)

    async def resume(self, checkpoint_id: str) -> PhaseResponse:
        return await phases.phase_call(self, "resume", checkpoint_id)

    async def abort(self, checkpoint_id: str) -> PhaseResponse:
        """Idempotent for an aborted or never-seen checkpoint (presumed abort)."""
        return await phases.phase_call(self, "abort", checkpoint_id)

    # -- the one trainer that drives the agent ------------------------------------------------------------

    def drive_as(self, trainer_id: str | None) -> None:
        """Names `trainer_id` on every later call that changes what the agent holds (`x-ledger-trainer`),
        so the agent refuses this client's calls if another trainer drives it (participant.driver)."""
        self._trainer = ((TRAINER_HEADER.encode(), (trainer_id or "").encode()),)

    async def bind_driver(self, trainer_id: str | None) -> DriverResponse | None:
        """`POST /driver`: binds the agent to `trainer_id`, or raises `TrainerConflictError` naming the
        trainer that drives it.  None for an agent without the route (a plain Gym agent, an older
        participant): it cannot tell trainers apart."""
        return await control.driver_call(self, "/driver", trainer_id)

    async def release_driver(self, trainer_id: str | None) -> DriverResponse | None:
        """`POST /driver/release`: unbinds the agent if it holds nothing of `trainer_id` (else it stays
        bound, for that trainer's recovery)."""
        return await control.driver_call(self, "/driver/release", trainer_id)

    # -- reference-agent debugging -----------------------------------------------------------------------

    async def set_faults(self, fault: AttemptFault | RateFaults | CrashAfter) -> None:
        await control.set_faults(self, fault)

    async def debug_runs(self) -> dict[str, int]:
        return await control.debug_runs(self)
