"""One attempt's life: dispatch, reply, keep, seal; or retire, or adopt.

Whoever settles an attempt (its own /run task, its group giving up on it, a checkpoint prepare that
found it finished at the agent) holds the attempt's `LiveAttempt` lock and records the outcome there,
so an attempt is settled once however many parties race for it.  The table of live attempts follows
the groups in play (`forget_group`), not the trainer's history.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from eventstore.events import Event, FailureKind, RetireCause, RetireOwed, RunDispatched, RunFailed
from projections.ledger import AttemptState, GroupState, LedgerState
from protocol import mutants
from protocol.ids import capture_key, group_id_of
from protocol.streams import group_stream
from protocol.wire import RunReply
from trainer.agents import Agents
from trainer.core import attempt as core
from trainer.core.group import FINISHED, AttemptOutcome, kept, recorded_outcome
from trainer.errors import NotOwned
from trainer.gate import Gate, Lease
from trainer.gym import Completed, GymClient
from trainer.gym.errors import (
    AgentServerError,
    AgentTimeoutError,
    AgentUnavailableError,
    BadResponseError,
    CheckpointConflictError,
    ConnectionLostError,
    GoneError,
    GymError,
    InvalidPhaseError,
    InvalidRequestError,
    NotFoundError,
    StaleCheckpointError,
    TrainerConflictError,
)
from trainer.journal import Journal
from trainer.keep import FetchFailed, Garbage, Keeper, Kept, OtherIncarnation
from trainer.rows import run_request
from trainer.settings import Settings, log


@dataclass(frozen=True)
class RetireFor:
    """Why the trainer retires an attempt that did not fail: a checkpoint's prepare needs it gone."""

    cause: RetireCause
    checkpoint_id: str
    reason: str


@dataclass
class LiveAttempt:
    """Serialises everyone who may settle one attempt (its /run task, a group abandoning it, a prepare)."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    outcome: AttemptOutcome | None = None


def _failure_kind(exc: BaseException) -> tuple[FailureKind, str]:
    if isinstance(exc, ConnectionLostError):
        return "stream_closed", str(exc)
    if isinstance(exc, AgentTimeoutError | TimeoutError):
        return "deadline", str(exc) or "deadline passed"
    if isinstance(exc, AgentUnavailableError):
        return "agent_lost", str(exc)
    if isinstance(exc, AgentServerError):
        return "env", str(exc)
    if isinstance(exc, FetchFailed):
        return "receipt", str(exc)
    if isinstance(exc, InvalidRequestError):
        # 400/413/422: the same request is refused the same way every time (never worth a retry).
        return "refused", str(exc)
    if isinstance(exc, GymError):
        return "http", str(exc)
    return "unknown", f"{type(exc).__name__}: {exc}"


class Attempts:
    def __init__(
        self,
        journal: Journal,
        agents: Agents,
        settings: Settings,
        gate: Gate,
        keeper: Keeper,
        wake_acks: Callable[[], None],
        wake_retires: Callable[[], None],
    ) -> None:
        self.journal = journal
        self.agents = agents
        self.settings = settings
        self.gate = gate
        self.keeper = keeper
        self._wake_acks = wake_acks
        self._wake_retires = wake_retires
        self._live: dict[tuple[str, int], LiveAttempt] = {}
        self._live_by_group: dict[str, list[tuple[str, int]]] = {}

    # --- the live table ------------------------------------------------------------------------

    def live(self, rollout_id: str, attempt_index: int) -> LiveAttempt:
        key = (rollout_id, attempt_index)
        found = self._live.get(key)
        if found is None:
            found = self._live[key] = LiveAttempt()
            self._live_by_group.setdefault(group_id_of(rollout_id), []).append(key)
        return found

    def forget_group(self, group_id: str) -> None:
        """Drops the settled attempts of a group that left play (the log holds their outcomes), so the
        trainer's memory follows the groups in play, not its history; an attempt still held stays."""
        for key in self._live_by_group.pop(group_id, []):
            live = self._live.get(key)
            if live is not None and not live.lock.locked():
                del self._live[key]

    # --- the whole attempt -------------------------------------------------------------------------

    async def settle(self, group_id: str, generation_index: int, attempt_index: int) -> AttemptOutcome:
        """Plays the attempt if it was never dispatched; otherwise finds out what became of it."""
        ledger = self.journal.ledger
        group = ledger.groups[group_id]
        sibling = group.siblings[generation_index]
        attempt = sibling.attempts[attempt_index]
        live = self.live(attempt.rollout_id, attempt_index)
        if live.outcome is not None:
            return live.outcome
        known = recorded_outcome(attempt)
        if known is not None:
            return known
        refused = self.agents.refused.get(group.agent_name)
        if refused is not None:  # nothing more is sent to an agent that refused this trainer
            raise refused
        if attempt.status == "minted":
            return await self._play(group, attempt)
        # Dispatched by an earlier coordinator (or its reply went missing): retire or adopt.
        return await self.resolve(group_id, attempt.rollout_id, attempt_index)

    async def _play(self, group: GroupState, attempt: AttemptState) -> AttemptOutcome:
        rid, n = attempt.rollout_id, attempt.attempt_index
        client = self.agents.client(group.agent_name)
        key = capture_key(rid, n)
        dispatched = asyncio.Event()

        async def dispatch() -> None:
            # Recorded once the /run holds a connection, right before it is sent: the attempt's lease
            # starts here, never while it waits behind other attempts in this trainer's own pool.
            await self.journal.append(
                group_stream(group.group_id),
                [
                    RunDispatched(
                        rollout_id=rid,
                        attempt_index=n,
                        capture_key=key,
                        agent_name=group.agent_name,
                        deadline_s=self.settings.rollout_timeout_s,
                        prompt_digest=request.prompt_digest(),
                        continue_from=resumes,
                    )
                ],
            )
            dispatched.set()

        request = run_request(group, rid, n)
        # A replacement at target level turn resumes its predecessor's offered continuation.
        resumes = attempt.continues.digest if attempt.continues is not None else None
        task = asyncio.create_task(
            client.run_completed(request, on_slot=dispatch, continue_from=resumes), name=f"run:{key}"
        )
        failure: BaseException | None = None
        reply: Completed | None = None
        try:
            admitted = asyncio.create_task(dispatched.wait())
            try:
                await asyncio.wait({task, admitted}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                admitted.cancel()
            lease = Lease(self.gate, self.settings.rollout_timeout_s)
            while not task.done():
                # Not kept in a local: the set holds the task, and the task its answer.
                if (await asyncio.wait({task}, timeout=max(0.0, min(lease.remaining, 0.25))))[0]:
                    break
                if lease.tick() <= 0:
                    task.cancel()
                    failure = TimeoutError(f"no reply within the {self.settings.rollout_timeout_s} s lease")
                    break
        finally:
            if not task.done():
                task.cancel()
        if failure is None:
            try:
                reply = task.result()
            except GymError as exc:
                failure = exc
        del task  # the answer's only holder from here is `reply`, let go of once it is stored
        if isinstance(failure, TrainerConflictError):
            # The agent refuses this trainer: the attempt never ran there, and nothing is recorded or
            # owed (trainer.core.refusal); the group waits open for a recovery once the agent is free.
            raise self.agents.refuse(group.agent_name, failure.message)
        if failure is not None and not dispatched.is_set():
            # Failed before it was sent (the agent's identity, the wait for a connection): recorded
            # as a dispatch that failed, and retired at the agent like any other.
            await dispatch()
        live = self.live(rid, n)
        async with live.lock:
            if live.outcome is not None:
                return live.outcome
            if reply is not None:
                try:
                    result = await self.keeper.keep(group.group_id, reply.reply, adopted=False, carried=reply)
                except FetchFailed as exc:
                    failure = exc
                else:
                    # Stored: the reply, its bytes, the HTTP body and the token records are not held
                    # while the append waits for the journal's group commit (most of an attempt's time
                    # between its answer and its seal; their buffers, freed in bursts, fragment the heap).
                    reply = None
                    live.outcome = await self.seal(result)
                    return live.outcome
            assert failure is not None
            kind, reason = _failure_kind(failure)
            await self._append(
                group.group_id,
                [RunFailed(rollout_id=rid, attempt_index=n, reason=reason[:500], kind=kind)],
            )
            if mutants.active("replace_without_retire"):
                live.outcome = AttemptOutcome("retired", reason)
                return live.outcome
            live.outcome = await self._resolve_locked(group.group_id, rid, n)
            return live.outcome

    # --- a reply in hand ------------------------------------------------------------------------

    async def finish(
        self,
        group_id: str,
        reply: RunReply,
        *,
        adopted: bool,
        expect_incarnation: str | None = None,
        carried: Completed | None = None,
    ) -> AttemptOutcome:
        """Receipt, verify, tokens, then one atomic append: seal (or hold) and the ACK debt."""
        result = await self.keeper.keep(
            group_id, reply, adopted=adopted, expect_incarnation=expect_incarnation, carried=carried
        )
        return await self.seal(result)

    async def seal(self, result: Kept | AttemptOutcome) -> AttemptOutcome:
        """The one atomic append of a kept attempt: its reply, then what its group records with it
        (`trainer.core.group.kept`: the seal or hold and the ACK debt)."""
        if isinstance(result, AttemptOutcome):
            return result
        if mutants.active("ack_before_durable"):
            with contextlib.suppress(GymError):
                await self.agents.client(result.agent_name).acknowledge([result.receipt])

        def build(ledger: LedgerState) -> list[Event]:
            group = ledger.groups.get(result.group_id)
            return [*result.head, *kept(group, result.agent_name, result.rollout_receipt, result.receipt)]

        await self.journal.append(group_stream(result.group_id), build)
        self._wake_acks()
        return FINISHED

    # --- retire or adopt ---------------------------------------------------------------------------

    async def resolve(
        self, group_id: str, rollout_id: str, attempt_index: int, why: RetireFor | None = None
    ) -> AttemptOutcome:
        """Retire the attempt; adopt it if it finished (docs/protocol.md, Retire or adopt).  Settles it once.
        `why`: a checkpoint's prepare retires it (recorded with its `AttemptRetired` if it was running)."""
        refusal = self.agents.driver.refusal(self.journal.ledger, rollout_id, "settle", group_id)
        if refusal is not None:
            raise NotOwned(refusal)
        live = self.live(rollout_id, attempt_index)
        async with live.lock:
            if live.outcome is not None:
                return live.outcome
            attempt = self.journal.ledger.attempt(rollout_id, attempt_index)
            known = recorded_outcome(attempt) if attempt is not None else None
            live.outcome = known or await self._resolve_locked(group_id, rollout_id, attempt_index, why)
            return live.outcome

    async def _resolve_locked(
        self, group_id: str, rid: str, n: int, why: RetireFor | None = None
    ) -> AttemptOutcome:
        """Performs the retire/adopt steps of trainer.core.attempt until the attempt is settled."""
        group = self.journal.ledger.groups[group_id]
        client = self.agents.client(group.agent_name)
        state = core.Retiring(rid, n, policy=self.settings.retire_policy, agent_name=group.agent_name)
        action: core.CallRetire | core.CallAdopt | core.Settled = core.CallRetire()
        adopted: AttemptOutcome | None = None
        while True:
            if self.gate.closing:
                raise asyncio.CancelledError
            if isinstance(action, core.Settled):
                break
            if action.delay_s:
                await asyncio.sleep(action.delay_s)
            named = core.checkpoint_to_name(state, self.gate.checkpoint)
            got: core.Input
            if isinstance(action, core.CallAdopt):
                got, adopted = await self._adopt(group_id, client, rid, n, action.expect_incarnation)
            else:
                got = await retire_answer(client, rid, n, named)
            step = core.on(state, got, now=time.monotonic(), jitter=random.random(), checkpoint_id=named)
            state, action = step.state, step.action
            if step.events:
                await self._append(group_id, list(step.events))
                if any(isinstance(e, RetireOwed) for e in step.events):
                    self._wake_retires()
        if action.kind == "refused":
            raise self.agents.refuse(group.agent_name, action.reason)
        if action.kind == "finished":
            assert adopted is not None
            return adopted
        if action.kind in ("stranded", "lost"):
            log.error("(%s, %d): %s", rid, n, action.reason)
            return AttemptOutcome("stranded", action.reason)
        if why is not None and action.retire_outcome == "cancelled":
            # Cancelled for the checkpoint: its reason, cause and the work it threw away are the log's.
            return AttemptOutcome(
                "retired",
                why.reason,
                action.retire_outcome,
                execution_generation=action.execution_generation,
                execution_incarnation=action.execution_incarnation,
                cause=why.cause,
                checkpoint_id=why.checkpoint_id,
                work=action.work,
                continuation=action.continuation,
                resume=action.resume,
            )
        return AttemptOutcome(
            "retired",
            action.reason,
            action.retire_outcome,
            execution_generation=action.execution_generation,
            execution_incarnation=action.execution_incarnation,
            work=action.work,
            continuation=action.continuation,
            resume=action.resume,
        )

    async def _adopt(
        self, group_id: str, client: GymClient, rid: str, n: int, incarnation: str | None
    ) -> tuple[core.Input, AttemptOutcome | None]:
        """Re-POST /run marked adopt-only: the agent replays the stored reply or answers not found,
        and never runs the attempt again.  The receipt must come from `incarnation` (the agent process that
        answered retire)."""
        group = self.journal.ledger.groups[group_id]
        try:
            reply = await client.run(
                run_request(group, rid, n), timeout_s=self.settings.adopt_timeout_s, adopt_only=True
            )
            outcome = await self.finish(group_id, reply, adopted=True, expect_incarnation=incarnation)
            return core.AdoptResult("adopted"), outcome
        except OtherIncarnation as exc:
            log.warning("adopting (%s, %d): %s", rid, n, exc)
            return core.AdoptResult("other_incarnation", str(exc)), None
        except (BadResponseError, Garbage) as exc:
            log.warning("adopting (%s, %d): the agent answered garbage: %s", rid, n, exc)
            return core.AdoptResult("garbage", str(exc)[:300]), None
        except NotFoundError as exc:
            return core.AdoptResult("not_found", str(exc)[:300]), None
        except GoneError as exc:
            return core.AdoptResult("gone", str(exc)[:300]), None
        except TrainerConflictError as exc:
            return core.DriverRefused(exc.message), None
        except (GymError, FetchFailed) as exc:
            return core.CallFailed(f"adoption: {exc}"[:300]), None

    async def _append(self, group_id: str, events: list[Event]) -> None:
        await self.journal.append(group_stream(group_id), events)


async def retire_answer(
    client: GymClient, rid: str, n: int, checkpoint_id: str | None
) -> core.RetireAnswer | core.RetireRefused | core.CallFailed | core.DriverRefused:
    """One /retire, its answer in the core's terms."""
    try:
        a = await client.retire(rid, n, checkpoint_id)
    except InvalidPhaseError:
        return core.RetireRefused("invalid_phase")
    except StaleCheckpointError:
        return core.RetireRefused("stale")
    except CheckpointConflictError:
        return core.RetireRefused("conflict")
    except TrainerConflictError as exc:
        return core.DriverRefused(exc.message)
    except GymError as exc:
        return core.CallFailed(f"retire: {type(exc).__name__}: {exc}"[:300])
    detail = client.reduced.retire_detail(rid, n) if client.reduced is not None else ""
    return core.RetireAnswer(
        a.retired,
        a.tombstoned,
        a.completed_unacknowledged,
        a.done,
        a.execution_generation,
        a.execution_incarnation,
        a.work,
        a.continuation,
        a.resume,
        detail,
    )
