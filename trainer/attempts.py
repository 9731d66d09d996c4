"""One try's life: dispatch, reply, receipt, tokens, verify, append; or retire, or adopt.

Whoever settles a try (its own /run task, its group giving up on it, a checkpoint prepare that
found it finished at the agent) holds the try's `LiveAttempt` lock and records the outcome there, so a
try is settled once however many parties race for it.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any, Final

from pydantic import ValidationError

from eventstore.events import (
    AckOwed,
    AttemptAdopted,
    ContinuationDeclined,
    ContinuationResumed,
    Event,
    FailureKind,
    GroupSealed,
    ReceiptFetched,
    RetireOwed,
    RolloutReceipt,
    RunDispatched,
    RunFailed,
    RunReplied,
    SiblingHeld,
    SiblingSealed,
)
from payloads import PayloadClaim
from payloads.replies import REPLY_APART_MEDIA_TYPE, REPLY_MEDIA_TYPE, reply_to_store
from payloads.token_arrays import TokenArrays
from projections.ledger import AttemptState, GroupState, LedgerState
from protocol.digests import canonical_bytes
from protocol.ids import capture_key, group_id_of, rollout_id_of
from protocol.streams import group_stream
from protocol.token_codec import TokenLayout, referred, reply_output_of
from protocol.wire import AttemptRef, CompletionReceipt, ResumeReport, RunReply, RunRequest, validation_line
from trainer.context import AttemptOutcome, Context, Lease, RetireFor, log
from trainer.core import attempt as core
from trainer.errors import InvalidRow, NotOwned
from trainer.gym import Completed, GymClient, verify_receipt
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
    ReceiptMismatchError,
    StaleCheckpointError,
)
from trainer.payload_io import PayloadIO

FINISHED = AttemptOutcome("finished")


@dataclass(frozen=True, slots=True)
class _Kept:
    """A try whose payloads are stored, as its seal's append needs it: events and receipts (claims,
    digests, counts), none of the reply's or the token records' bytes."""

    group_id: str
    agent_name: str
    head: list[Event]
    rollout_receipt: RolloutReceipt
    receipt: CompletionReceipt


def _beside_reply(tokens: TokenArrays, reply_payload: dict[str, Any]) -> tuple[bytes, str, TokenLayout]:
    """Token records as stored beside their reply: their output items (the call's output text) refer
    to the reply's, which holds them once (version 2 of the binary form); and their layout."""
    return referred(memoryview(tokens.buffer), reply_output_of(reply_payload), layout=tokens.layout)


class _Unverifiable(Exception):
    """The agent's receipt or tokens do not describe the reply: recorded, never sealed."""


class _FetchFailed(Exception):
    """The receipt or token fetch failed in transport: the try is lost and goes through retire."""


class _Garbage(_FetchFailed):
    """The agent answered, but not with a receipt of this try: nothing can be sealed or owed."""


class _OtherIncarnation(_Garbage):
    """An adoption's receipt comes from another execution than the one that answered retire: the
    agent restarted in between and this is not the result retire described."""


# The try's identity is the log's, never the payload's.
_IDENTITY = frozenset({"_ng_rollout_id", "_ng_attempt_index", "rollout_id", "attempt_index"})


def run_request(group: GroupState, rollout_id: str, attempt_index: int) -> RunRequest:
    """The try's `/run` row as NeMo RL sends one (`request_row` of the group's payload)."""
    return request_row(group.payload, rollout_id, attempt_index)


def request_row(payload: dict[str, Any], rollout_id: str, attempt_index: int) -> RunRequest:
    """A try's `/run` row as NeMo RL sends one: its identity, `responses_create_params`, and the
    payload's other fields (a NeMo RL row's `agent_ref`, `_ng_task_index`, environment fields such as
    `expected_answer`) at the row's top level; a payload's `task` object, if it has one, is spread
    there too (its fields never override the row's own)."""
    payload = {k: v for k, v in payload.items() if k not in _IDENTITY}
    task = payload.pop("task", None)
    if isinstance(task, dict):
        payload = {k: v for k, v in task.items() if k not in _IDENTITY} | payload
    return RunRequest(
        rollout_id=rollout_id,
        attempt_index=attempt_index,
        responses_create_params=payload.pop("responses_create_params", {}),
        **payload,
    )


def check_row(payload: dict[str, Any], what: str) -> None:
    """`InvalidRow`, in one line naming `what`, when `payload` makes no row an agent takes:
    `RunRequest`'s rules (a number JSON cannot carry, nesting past the cap) and canonical JSON's
    (text no JSON can carry, such as a lone surrogate).  Asked before a group is reserved: a row
    refused later would leave its group reserved and never dispatched."""
    try:
        request_row(payload, _ANY_TRY, 0).prompt_digest()
    except ValidationError as exc:
        raise InvalidRow(f"{what}: its payload is no /run row: {validation_line(exc, 'row')}") from None
    except ValueError as exc:  # UnicodeEncodeError among them
        raise InvalidRow(f"{what}: its payload is no /run row: {exc}") from None


# A try's identity for `check_row`: the row's rules do not depend on it.
_ANY_TRY: Final = rollout_id_of("row", 0)


def from_ledger(attempt: AttemptState) -> AttemptOutcome | None:
    """The outcome the log already holds for a try, if any."""
    if attempt.status in ("held", "sealed"):
        return FINISHED
    if attempt.receipt is not None:
        return AttemptOutcome("owed", "finished at the agent; result not kept")
    if attempt.retire_outcome in ("cancelled", "tombstoned", "done"):
        return AttemptOutcome(
            "retired", "retired", attempt.retire_outcome, recorded=True, continuation=attempt.offered
        )
    return None


def _failure_kind(exc: BaseException) -> tuple[FailureKind, str]:
    if isinstance(exc, ConnectionLostError):
        return "stream_closed", str(exc)
    if isinstance(exc, AgentTimeoutError | TimeoutError):
        return "deadline", str(exc) or "deadline passed"
    if isinstance(exc, AgentUnavailableError):
        return "agent_lost", str(exc)
    if isinstance(exc, AgentServerError):
        return "env", str(exc)
    if isinstance(exc, _FetchFailed):
        return "receipt", str(exc)
    if isinstance(exc, InvalidRequestError):
        # 400/413/422: the same request is refused the same way every time (never worth a retry).
        return "refused", str(exc)
    if isinstance(exc, GymError):
        return "http", str(exc)
    return "unknown", f"{type(exc).__name__}: {exc}"


class Attempts:
    def __init__(self, ctx: Context, payloads: PayloadIO) -> None:
        self.ctx = ctx
        self.payloads = payloads

    # --- the whole try -----------------------------------------------------------------------

    async def settle(self, group_id: str, generation_index: int, attempt_index: int) -> AttemptOutcome:
        """Plays the try if it was never dispatched; otherwise finds out what became of it."""
        ledger = self.ctx.journal.ledger
        group = ledger.groups[group_id]
        sibling = group.siblings[generation_index]
        attempt = sibling.attempts[attempt_index]
        live = self.ctx.live_attempt(attempt.rollout_id, attempt_index)
        if live.outcome is not None:
            return live.outcome
        known = from_ledger(attempt)
        if known is not None:
            return known
        if attempt.status == "minted":
            return await self._play(group, attempt)
        # Dispatched by an earlier coordinator (or its reply went missing): retire or adopt.
        return await self.resolve(group_id, attempt.rollout_id, attempt_index)

    async def _play(self, group: GroupState, attempt: AttemptState) -> AttemptOutcome:
        ctx = self.ctx
        rid, n = attempt.rollout_id, attempt.attempt_index
        client = ctx.client(group.agent_name)
        key = capture_key(rid, n)
        dispatched = asyncio.Event()

        async def dispatch() -> None:
            # Recorded once the /run holds a connection, right before it is sent: the try's lease
            # starts here, never while it waits behind other tries in this trainer's own pool.
            await ctx.journal.append(
                group_stream(group.group_id),
                [
                    RunDispatched(
                        rollout_id=rid,
                        attempt_index=n,
                        capture_key=key,
                        agent_name=group.agent_name,
                        deadline_s=ctx.settings.rollout_timeout_s,
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
            lease = Lease(ctx, ctx.settings.rollout_timeout_s)
            while not task.done():
                # Not kept in a local: the set holds the task, and the task its answer.
                if (await asyncio.wait({task}, timeout=max(0.0, min(lease.remaining, 0.25))))[0]:
                    break
                if lease.tick() <= 0:
                    task.cancel()
                    failure = TimeoutError(f"no reply within the {ctx.settings.rollout_timeout_s} s lease")
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
        if failure is not None and not dispatched.is_set():
            # Failed before it was sent (the agent's identity, the wait for a connection): recorded
            # as a dispatch that failed, and retired at the agent like any other.
            await dispatch()
        live = ctx.live_attempt(rid, n)
        async with live.lock:
            if live.outcome is not None:
                return live.outcome
            if reply is not None:
                try:
                    kept = await self.keep(group.group_id, reply.reply, adopted=False, carried=reply)
                except _FetchFailed as exc:
                    failure = exc
                else:
                    # Stored: the reply, its bytes, the HTTP body and the token records are not held
                    # while the append waits for the journal's group commit (most of a try's time
                    # between its answer and its seal; their buffers, freed in bursts, fragment the heap).
                    reply = None
                    live.outcome = await self.seal(kept)
                    return live.outcome
            assert failure is not None
            kind, reason = _failure_kind(failure)
            await self._append(
                group.group_id,
                [RunFailed(rollout_id=rid, attempt_index=n, reason=reason[:500], kind=kind)],
            )
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
        """Receipt, verify, tokens, then one atomic append: seal (or hold) and the ACK debt (`keep`,
        then `seal`)."""
        kept = await self.keep(
            group_id, reply, adopted=adopted, expect_incarnation=expect_incarnation, carried=carried
        )
        return await self.seal(kept)

    async def keep(
        self,
        group_id: str,
        reply: RunReply,
        *,
        adopted: bool,
        expect_incarnation: str | None = None,
        carried: Completed | None = None,
    ) -> _Kept | AttemptOutcome:
        """Receipt, verify, tokens, and the payloads stored: what `seal` appends, or the outcome of a
        try that is owed, not sealed (already recorded).  Nothing of the reply's or the records' bytes
        is in what it returns, so a caller that lets go of `reply` and `carried` holds none of them.
        `carried`: the `/run` answer, with the receipt and token records if it carried them (then
        they are not fetched; either is checked exactly as a fetched one)."""
        ctx = self.ctx
        group = ctx.journal.ledger.groups[group_id]
        client = ctx.client(group.agent_name)
        rid, n = reply.rollout_id, reply.attempt_index
        reply_payload = reply.parsed_payload()  # read off the `/run` body: JSON already
        try:
            receipt = carried.carried_receipt() if carried is not None else None
            if receipt is None:
                receipt = await client.completion_receipt(rid, n)
        except BadResponseError as exc:
            raise _Garbage(f"completion receipt of ({rid}, {n}): {exc}") from exc
        except GymError as exc:
            raise _FetchFailed(f"completion receipt of ({rid}, {n}): {exc}") from exc
        if expect_incarnation is not None and receipt.execution_incarnation != expect_incarnation:
            raise _OtherIncarnation(
                f"the receipt of ({rid}, {n}) is from agent incarnation {receipt.execution_incarnation}, "
                f"retire was answered by incarnation {expect_incarnation}"
            )
        adopted_events: list[Event] = [AttemptAdopted(rollout_id=rid, attempt_index=n)] if adopted else []
        adopted_events += resume_events(rid, n, receipt.resume)
        # The reply itself is a payload, stored before the seal under the digest the agent's receipt
        # names (`RunReply.digest()`: its canonical JSON), so a trainer gets `response` back.  Every
        # payload is hashed once: its claim's digest is the one the receipt and the seal name.
        reply_bytes, reply_claim = self._reply_json(
            reply_payload, receipt.result_digest, carried.reply_json if carried is not None else None
        )
        digest = reply_claim.digest
        try:
            verify_receipt(reply, receipt, digest)
            if reply.masked() and ctx.settings.mask_sample_retries:
                await self.payloads.put([(reply_bytes, REPLY_MEDIA_TYPE)], claims=[reply_claim])
                await self._append(
                    group_id,
                    [
                        *adopted_events,
                        RunReplied(
                            rollout_id=rid,
                            attempt_index=n,
                            reward=reply.reward,
                            mask_sample=True,
                            reply_digest=digest,
                            failure_kind=reply.failure_kind,
                            reply=reply_claim,
                        ),
                        ReceiptFetched(agent_name=group.agent_name, receipt=receipt),
                        AckOwed(agent_name=group.agent_name, receipt=receipt),
                    ],
                )
                ctx.ack_wakeup.set()
                return AttemptOutcome(
                    "owed", f"mask_sample: {reply.failure_reason or 'the environment failed'}"
                )
            try:
                tokens = carried.carried_tokens() if carried is not None else None
                if tokens is None:
                    tokens = await client.token_capture(receipt.manifest_capture_key)
            except BadResponseError as exc:
                # The receipt verified against the reply, so it is the agent's own: owe and ACK it (the
                # agent's copy is released), but a token list that does not parse is never sealed.
                raise _Unverifiable(f"token capture {receipt.manifest_capture_key}: {exc}") from exc
            except GymError as exc:
                raise _FetchFailed(f"token capture {receipt.manifest_capture_key}: {exc}") from exc
            tokens_bytes, tokens_type, tokens_layout = _beside_reply(tokens, reply_payload)
            tokens_claim = self.payloads.claim(tokens_bytes, tokens_type)
            rollout_receipt = build_rollout_receipt(reply, receipt, tokens, tokens_claim)
            # A real Gym agent's reply carries the arrays its records hold: stored apart from them.
            stored, stored_type = reply_to_store(
                reply_payload, reply_bytes, tokens_bytes, tokens_type, tokens_layout
            )
            stored_claim = reply_claim if stored is reply_bytes else self.payloads.claim(stored, stored_type)
        except (ReceiptMismatchError, _Unverifiable) as exc:
            # The agent still holds a finished result: owe it the ACK of the receipt it issued (so
            # nothing strands), but never seal what did not verify.
            await self._append(
                group_id,
                [
                    *adopted_events,
                    RunFailed(rollout_id=rid, attempt_index=n, reason=str(exc)[:500], kind="verify"),
                    ReceiptFetched(agent_name=group.agent_name, receipt=receipt),
                    AckOwed(agent_name=group.agent_name, receipt=receipt),
                ],
            )
            ctx.ack_wakeup.set()
            return AttemptOutcome("owed", f"unverifiable: {exc}")
        # Durable before the append that claims them (the seal is the claim check).
        await self.payloads.put(
            [(tokens_bytes, tokens_type), (stored, stored_type)], claims=[tokens_claim, stored_claim]
        )
        head: list[Event] = [
            *adopted_events,
            RunReplied(
                rollout_id=rid,
                attempt_index=n,
                reward=reply.reward,
                mask_sample=reply.masked(),
                reply_digest=digest,
                failure_kind=reply.failure_kind,
                reply=stored_claim,
                apart_from=tokens_claim if stored_type == REPLY_APART_MEDIA_TYPE else None,
            ),
            ReceiptFetched(agent_name=group.agent_name, receipt=receipt),
        ]
        return _Kept(group_id, group.agent_name, head, rollout_receipt, receipt)

    def _reply_json(
        self, reply_payload: dict[str, Any], receipt_digest: str, carried_json: bytes | None
    ) -> tuple[bytes, PayloadClaim]:
        """The reply's canonical JSON and its claim.  The JSON a completion frame carried (of the value
        the trainer holds, `Completed.reply_json`) is it when it hashes to the receipt's digest: taken
        as it came, nothing written (a real Gym reply's is 290 KB at 9k tokens, its logprobs' small
        floats mended one by one).  Otherwise the reply's own canonical JSON, to verify as ever."""
        if carried_json is not None:
            claim = self.payloads.claim(carried_json, REPLY_MEDIA_TYPE)
            if claim.digest == receipt_digest:
                return carried_json, claim
        reply_bytes = canonical_bytes(reply_payload)
        return reply_bytes, self.payloads.claim(reply_bytes, REPLY_MEDIA_TYPE)

    async def seal(self, kept: _Kept | AttemptOutcome) -> AttemptOutcome:
        """The one atomic append of a kept try: its reply, then its seal (or hold) and the ACK debt."""
        if isinstance(kept, AttemptOutcome):
            return kept
        ctx = self.ctx

        def build(ledger: LedgerState) -> list[Event]:
            owed = AckOwed(agent_name=kept.agent_name, receipt=kept.receipt)
            current = ledger.groups.get(kept.group_id)
            if current is None or current.status != "open":
                return [*kept.head, owed]
            return [*kept.head, *self.keep_events(current, kept.rollout_receipt, kept.receipt)]

        await ctx.journal.append(group_stream(kept.group_id), build)
        ctx.ack_wakeup.set()
        return FINISHED

    def keep_events(
        self, group: GroupState, rollout_receipt: RolloutReceipt, receipt: CompletionReceipt
    ) -> list[Event]:
        """Seal (sibling) or hold (prompt_group) plus the debt, recorded as the sibling arrives."""
        rid, n = rollout_receipt.rollout_id, rollout_receipt.attempt_index
        owed = AckOwed(agent_name=group.agent_name, receipt=receipt)
        if group.mode == "sibling":
            events: list[Event] = [
                SiblingSealed(
                    rollout_id=rid, attempt_index=n, reward=rollout_receipt.reward, receipt=rollout_receipt
                ),
                owed,
            ]
            others_sealed = all(s.status == "sealed" for s in group.siblings.values() if s.rollout_id != rid)
            if others_sealed:
                events.append(GroupSealed(group_id=group.group_id, attempts=_sealed_refs(group, rid, n)))
            return events
        events = [SiblingHeld(rollout_id=rid, attempt_index=n, receipt=rollout_receipt), owed]
        return events + self.seal_if_complete(group, rid, rollout_receipt)

    @staticmethod
    def seal_if_complete(group: GroupState, rid: str, held: RolloutReceipt | None) -> list[Event]:
        """prompt_group: when the last sibling arrives, SiblingSealed x G + GroupSealed."""
        receipts: list[RolloutReceipt] = []
        for sibling in sorted(group.siblings.values(), key=lambda s: s.generation_index):
            if held is not None and sibling.rollout_id == rid:
                receipts.append(held)
                continue
            current = sibling.attempts.get(sibling.current_attempt)
            if sibling.status != "held" or current is None or current.rollout_receipt is None:
                return []
            receipts.append(current.rollout_receipt)
        seals: list[Event] = [
            SiblingSealed(rollout_id=r.rollout_id, attempt_index=r.attempt_index, reward=r.reward, receipt=r)
            for r in receipts
        ]
        refs = [AttemptRef(rollout_id=r.rollout_id, attempt_index=r.attempt_index) for r in receipts]
        return [*seals, GroupSealed(group_id=group.group_id, attempts=refs)]

    # --- retire or adopt ---------------------------------------------------------------------------

    async def resolve(
        self, group_id: str, rollout_id: str, attempt_index: int, why: RetireFor | None = None
    ) -> AttemptOutcome:
        """Retire the try; adopt it if it finished (docs/protocol.md, Retire or adopt).  Settles it once.
        `why`: a checkpoint's prepare retires it (recorded with its `AttemptRetired` if it was running)."""
        refusal = self.ctx.driver.refusal(self.ctx.journal.ledger, rollout_id, "settle", group_id)
        if refusal is not None:
            raise NotOwned(refusal)
        live = self.ctx.live_attempt(rollout_id, attempt_index)
        async with live.lock:
            if live.outcome is not None:
                return live.outcome
            attempt = self.ctx.journal.ledger.attempt(rollout_id, attempt_index)
            known = from_ledger(attempt) if attempt is not None else None
            live.outcome = known or await self._resolve_locked(group_id, rollout_id, attempt_index, why)
            return live.outcome

    async def _resolve_locked(
        self, group_id: str, rid: str, n: int, why: RetireFor | None = None
    ) -> AttemptOutcome:
        """Performs the retire/adopt steps of trainer.core.attempt until the try is settled."""
        ctx = self.ctx
        group = ctx.journal.ledger.groups[group_id]
        client = ctx.client(group.agent_name)
        state = core.Retiring(rid, n, policy=ctx.settings.retire_policy, agent_name=group.agent_name)
        action: core.CallRetire | core.CallAdopt | core.Settled = core.CallRetire()
        adopted: AttemptOutcome | None = None
        while True:
            if ctx.stopping:
                raise asyncio.CancelledError
            if isinstance(action, core.Settled):
                break
            if action.delay_s:
                await asyncio.sleep(action.delay_s)
            named = core.checkpoint_to_name(state, ctx.active_checkpoint)
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
                    ctx.retire_wakeup.set()
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
        and never runs the try again.  The receipt must come from `incarnation` (the agent process that
        answered retire)."""
        group = self.ctx.journal.ledger.groups[group_id]
        try:
            reply = await client.run(
                run_request(group, rid, n), timeout_s=self.ctx.settings.adopt_timeout_s, adopt_only=True
            )
            outcome = await self.finish(group_id, reply, adopted=True, expect_incarnation=incarnation)
            return core.AdoptResult("adopted"), outcome
        except _OtherIncarnation as exc:
            log.warning("adopting (%s, %d): %s", rid, n, exc)
            return core.AdoptResult("other_incarnation", str(exc)), None
        except (BadResponseError, _Garbage) as exc:
            log.warning("adopting (%s, %d): the agent answered garbage: %s", rid, n, exc)
            return core.AdoptResult("garbage", str(exc)[:300]), None
        except NotFoundError as exc:
            return core.AdoptResult("not_found", str(exc)[:300]), None
        except GoneError as exc:
            return core.AdoptResult("gone", str(exc)[:300]), None
        except (GymError, _FetchFailed) as exc:
            return core.CallFailed(f"adoption: {exc}"[:300]), None

    async def _append(self, group_id: str, events: list[Event]) -> None:
        await self.ctx.journal.append(group_stream(group_id), events)


def resume_events(rid: str, n: int, resume: ResumeReport | None) -> list[Event]:
    """What a try asked to resume a continuation did, as the log records it (none: it was not asked)."""
    if resume is None:
        return []
    if resume.outcome == "resumed":
        return [ContinuationResumed(rollout_id=rid, attempt_index=n, resume=resume)]
    return [ContinuationDeclined(rollout_id=rid, attempt_index=n, resume=resume)]


async def retire_answer(
    client: GymClient, rid: str, n: int, checkpoint_id: str | None
) -> core.RetireAnswer | core.RetireRefused | core.CallFailed:
    """One /retire, its answer in the core's terms."""
    try:
        a = await client.retire(rid, n, checkpoint_id)
    except InvalidPhaseError:
        return core.RetireRefused("invalid_phase")
    except StaleCheckpointError:
        return core.RetireRefused("stale")
    except CheckpointConflictError:
        return core.RetireRefused("conflict")
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


def build_rollout_receipt(
    reply: RunReply, receipt: CompletionReceipt, tokens: TokenArrays, tokens_claim: PayloadClaim
) -> RolloutReceipt:
    """The sealed record of a try; `tokens` the records in their canonical binary form (what is
    stored), `tokens_claim` the claim of those bytes."""
    key = capture_key(reply.rollout_id, reply.attempt_index)
    if receipt.manifest_capture_key != key:
        raise _Unverifiable(
            f"receipt names capture key {receipt.manifest_capture_key!r}, the try's is {key!r}"
        )
    if not len(tokens):
        raise _Unverifiable(f"no token records under {key!r}")
    if any(r.get("rollout_id") != key for r in tokens.records):
        raise _Unverifiable(f"token records under {key!r} name another capture key")
    calls = tokens.model_call_ids
    if calls[-1] != receipt.terminal_model_call_id:
        raise _Unverifiable(
            f"last token record is {calls[-1]!r}, the receipt's terminal call is "
            f"{receipt.terminal_model_call_id!r}"
        )
    return RolloutReceipt(
        rollout_id=reply.rollout_id,
        attempt_index=reply.attempt_index,
        capture_key=key,
        model_call_ids=calls,
        terminal_model_call_id=receipt.terminal_model_call_id,
        token_count=tokens.token_count,
        tokens_digest=tokens_claim.digest,
        tokens=tokens_claim,
        reward=reply.reward,
        mask_sample=reply.masked(),
    )


def _sealed_refs(group: GroupState, rid: str, n: int) -> list[AttemptRef]:
    refs = []
    for sibling in sorted(group.siblings.values(), key=lambda s: s.generation_index):
        index = n if sibling.rollout_id == rid else sibling.sealed_attempt
        refs.append(
            AttemptRef(rollout_id=sibling.rollout_id, attempt_index=index if index is not None else 0)
        )
    return refs


__all__ = [
    "FINISHED",
    "Attempts",
    "build_rollout_receipt",
    "from_ledger",
    "group_id_of",
    "resume_events",
    "retire_answer",
    "run_request",
]
