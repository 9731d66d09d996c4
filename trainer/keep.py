"""A reply in hand: its receipt and token records fetched (or taken from the completion frame that
carried them) and checked against it, and its payloads stored before the append that claims them.

What `Keeper.keep` returns is what the seal's append needs (`Kept`: events and receipts, none of the
reply's or the token records' bytes), or the outcome of an attempt that is owed, not sealed (its
receipt and ACK debt already recorded: the agent holds a finished result, so it is never left
without a debt).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from eventstore.events import (
    AckOwed,
    AttemptAdopted,
    Event,
    ReceiptFetched,
    RolloutReceipt,
    RunFailed,
    RunReplied,
)
from payloads import PayloadClaim
from payloads.replies import REPLY_APART_MEDIA_TYPE, REPLY_MEDIA_TYPE, reply_to_store
from payloads.token_arrays import TokenArrays
from protocol import mutants
from protocol.digests import canonical_bytes
from protocol.ids import capture_key
from protocol.streams import group_stream
from protocol.token_codec import TokenLayout, referred, reply_output_of
from protocol.wire import CompletionReceipt, RunReply
from trainer.agents import Agents
from trainer.core.attempt import resume_events
from trainer.core.group import AttemptOutcome
from trainer.gym import Completed, verify_receipt
from trainer.gym.errors import BadResponseError, GymError, ReceiptMismatchError
from trainer.journal import Journal
from trainer.payload_io import PayloadIO
from trainer.settings import Settings


@dataclass(frozen=True, slots=True)
class Kept:
    """An attempt whose payloads are stored, as its seal's append needs it: events and receipts
    (claims, digests, counts), none of the reply's or the token records' bytes."""

    group_id: str
    agent_name: str
    head: list[Event]
    rollout_receipt: RolloutReceipt
    receipt: CompletionReceipt


class Unverifiable(Exception):
    """The agent's receipt or tokens do not describe the reply: recorded, never sealed."""


class FetchFailed(Exception):
    """The receipt or token fetch failed in transport: the attempt is lost and goes through retire."""


class Garbage(FetchFailed):
    """The agent answered, but not with a receipt of this attempt: nothing can be sealed or owed."""


class OtherIncarnation(Garbage):
    """An adoption's receipt comes from another execution than the one that answered retire: the
    agent restarted in between and this is not the result retire described."""


def _beside_reply(
    tokens: TokenArrays, reply_payload: dict[str, Any], beside: str | None
) -> tuple[bytes, str, TokenLayout]:
    """Token records as stored beside their reply: their output items (the call's output text) refer
    to the reply's, which holds them once (version 2 of the binary form).  `beside`: the media type
    where `tokens` already are that form (reduced mode made them so from this reply)."""
    if beside is not None:
        return bytes(tokens.buffer), beside, tokens.layout
    return referred(memoryview(tokens.buffer), reply_output_of(reply_payload), layout=tokens.layout)


class Keeper:
    def __init__(
        self,
        journal: Journal,
        agents: Agents,
        settings: Settings,
        payloads: PayloadIO,
        wake_acks: Callable[[], None],
    ) -> None:
        self.journal = journal
        self.agents = agents
        self.settings = settings
        self.payloads = payloads
        self._wake_acks = wake_acks

    async def keep(
        self,
        group_id: str,
        reply: RunReply,
        *,
        adopted: bool,
        expect_incarnation: str | None = None,
        carried: Completed | None = None,
    ) -> Kept | AttemptOutcome:
        """Receipt, verify, tokens, and the payloads stored: what `seal` appends, or the outcome of a
        attempt that is owed, not sealed (already recorded).  Nothing of the reply's or the records' bytes
        is in what it returns, so a caller that lets go of `reply` and `carried` holds none of them.
        `carried`: the `/run` answer, with the receipt and token records if it carried them (then
        they are not fetched; either is checked exactly as a fetched one)."""
        group = self.journal.ledger.groups[group_id]
        client = self.agents.client(group.agent_name)
        rid, n = reply.rollout_id, reply.attempt_index
        reply_payload = reply.parsed_payload()  # read off the `/run` body: JSON already
        try:
            receipt = carried.carried_receipt() if carried is not None else None
            if receipt is None:
                receipt = await client.completion_receipt(rid, n)
        except BadResponseError as exc:
            raise Garbage(f"completion receipt of ({rid}, {n}): {exc}") from exc
        except GymError as exc:
            raise FetchFailed(f"completion receipt of ({rid}, {n}): {exc}") from exc
        if expect_incarnation is not None and receipt.execution_incarnation != expect_incarnation:
            raise OtherIncarnation(
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
            if not (adopted and mutants.active("adopt_unverified")):
                verify_receipt(reply, receipt, digest)
            if reply.masked() and self.settings.mask_sample_retries:
                await self.payloads.put([(reply_bytes, REPLY_MEDIA_TYPE)], claims=[reply_claim])
                await self.journal.append(
                    group_stream(group_id),
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
                self._wake_acks()
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
                raise Unverifiable(f"token capture {receipt.manifest_capture_key}: {exc}") from exc
            except GymError as exc:
                raise FetchFailed(f"token capture {receipt.manifest_capture_key}: {exc}") from exc
            tokens_bytes, tokens_type, tokens_layout = _beside_reply(
                tokens, reply_payload, carried.tokens_beside if carried is not None else None
            )
            tokens_claim = self.payloads.claim(tokens_bytes, tokens_type)
            rollout_receipt = build_rollout_receipt(reply, receipt, tokens, tokens_claim)
            # A real Gym agent's reply carries the arrays its records hold: stored apart from them.
            stored, stored_type = reply_to_store(
                reply_payload, reply_bytes, tokens_bytes, tokens_type, tokens_layout
            )
            stored_claim = reply_claim if stored is reply_bytes else self.payloads.claim(stored, stored_type)
        except (ReceiptMismatchError, Unverifiable) as exc:
            # The agent still holds a finished result: owe it the ACK of the receipt it issued (so
            # nothing strands), but never seal what did not verify.
            await self.journal.append(
                group_stream(group_id),
                [
                    *adopted_events,
                    RunFailed(rollout_id=rid, attempt_index=n, reason=str(exc)[:500], kind="verify"),
                    ReceiptFetched(agent_name=group.agent_name, receipt=receipt),
                    AckOwed(agent_name=group.agent_name, receipt=receipt),
                ],
            )
            self._wake_acks()
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
        return Kept(group_id, group.agent_name, head, rollout_receipt, receipt)

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


def build_rollout_receipt(
    reply: RunReply, receipt: CompletionReceipt, tokens: TokenArrays, tokens_claim: PayloadClaim
) -> RolloutReceipt:
    """The sealed record of an attempt; `tokens` the records in their canonical binary form (what is
    stored), `tokens_claim` the claim of those bytes."""
    key = capture_key(reply.rollout_id, reply.attempt_index)
    if receipt.manifest_capture_key != key:
        raise Unverifiable(
            f"receipt names capture key {receipt.manifest_capture_key!r}, the try's is {key!r}"
        )
    if not len(tokens):
        raise Unverifiable(f"no token records under {key!r}")
    if any(r.get("rollout_id") != key for r in tokens.records):
        raise Unverifiable(f"token records under {key!r} name another capture key")
    calls = tokens.model_call_ids
    if calls[-1] != receipt.terminal_model_call_id:
        raise Unverifiable(
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
