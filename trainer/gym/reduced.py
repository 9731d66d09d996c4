"""Reduced mode: driving a plain Gym agent, one without the participant routes.

A plain agent answers `/run` and nothing else of the hand-off.  The client then gives the answers the
participant would have given, from what the trainer itself holds, so the coordinator runs unchanged:

- the completion receipt is made here: the reply's digest computed by the trainer, the token records
  read off the reply (`protocol.tokens`), execution generation `REDUCED_GENERATION` (0; a participant's
  generations are at least 1), so every receipt of a reduced-mode attempt says so in the log, and an
  incarnation of this client's own (what it holds goes with it, as an agent's goes with its process);
- acknowledge releases the trainer's own copy; nothing is sent (the agent keeps nothing to release);
- retire answers from what the trainer holds: a reply in hand is `completed_unacknowledged` (adopting
  it replays the trainer's copy, never a second `/run`); a try the trainer POSTed and holds no reply
  of (the agent answered an error, or the reply was lost) is `done`, saying which; one never POSTed is
  tombstoned; and a reply that arrives for a retired attempt afterwards is refused (410);
- status is always idle, and a checkpoint cannot include the agent: prepare/commit/resume/abort raise
  `NotParticipantError`, and the checkpointer leaves reduced agents out of its participants.

What remains guaranteed: no attempt is POSTed twice by the trainer (so none is executed twice on its
account), nothing is stranded at the agent (it keeps nothing), every group is sealed or dead-lettered.
What is lost: an attempt whose reply was lost cannot be adopted (its work is wasted and a replacement
runs), a running attempt cannot be cancelled at the agent (a retire only stops the trainer waiting), and
checkpoints do not pause the agent.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from protocol.digests import canonical_bytes, sha256_digest
from protocol.errors import RECEIPT_MISMATCH, UNKNOWN_EXECUTION
from protocol.ids import capture_key, mint_incarnation
from protocol.token_codec import TokenLayout, encode_entries, referring_entries, reply_output_of
from protocol.tokens import TokenRecordError, token_records_from_reply
from protocol.wire import (
    MAX_LIST_ITEMS,
    AcknowledgeResult,
    AgentStatus,
    AttemptRef,
    Capabilities,
    CompletionReceipt,
    RetireResponse,
    RunReply,
    TokenEntry,
)
from trainer.gym.errors import GoneError, NotFoundError, PhaseFenceError

REDUCED_GENERATION: Final = 0


@dataclass(frozen=True, slots=True)
class Kept:
    """A kept reply's receipt, its token records in the binary form as the trainer stores them beside
    the reply (`protocol.token_codec.referring_entries`: their media type and layout), and its
    canonical JSON."""

    receipt: CompletionReceipt
    tokens: bytes
    media_type: str
    layout: TokenLayout
    reply_json: bytes


class NotParticipantError(PhaseFenceError):
    """The agent has no participant routes (reduced mode): a checkpoint cannot include it."""


@dataclass
class _Held:
    reply: RunReply
    receipt: CompletionReceipt
    tokens: list[TokenEntry]
    # The records in the binary form (what `/token_capture` would answer), written when first asked
    # for: an adoption's fetch, never a reply kept and sealed.  (Its canonical JSON goes to the caller
    # alone: held until the ACK, it would be another copy of the reply.)
    encoded: bytes | None = None


class ReducedMode:
    def __init__(self, agent_name: str) -> None:
        self.agent_name = agent_name
        self.incarnation = mint_incarnation()
        self._held: dict[tuple[str, int], _Held] = {}
        self._tombstones: set[tuple[str, int]] = set()
        self._released: set[tuple[str, int]] = set()
        # Attempts POSTed to the agent with no reply held: what became of the POST, as far as we know.
        self._posted: dict[tuple[str, int], str] = {}

    def capabilities(self) -> Capabilities:
        return Capabilities(agent_name=self.agent_name, execution_incarnation=self.incarnation, features=[])

    def posting(self, rollout_id: str, attempt_index: int) -> None:
        """The attempt's `/run` is about to leave: from now on it may have run at the agent."""
        self._posted.setdefault(
            (rollout_id, attempt_index), "POSTed to the agent; no reply reached the trainer"
        )

    def unanswered(self, rollout_id: str, attempt_index: int, error: str) -> None:
        """The attempt's `/run` ended without a reply: the agent's error, or the call's."""
        self._posted[(rollout_id, attempt_index)] = f"POSTed to the agent, which gave no reply: {error}"[:300]

    def retire_detail(self, rollout_id: str, attempt_index: int) -> str:
        """Why retire called a POSTed attempt done ("" for any other answer)."""
        key = (rollout_id, attempt_index)
        return self._posted.get(key, "") if key in self._tombstones else ""

    def keep(self, reply: RunReply) -> Kept:
        """Holds a reply the agent answered (validated from its `/run` body: `RunReply.parsed_payload`
        is its JSON); refuses one of an attempt retired meanwhile.  What a participant's completion frame
        would have carried with it: the receipt, the token records in the binary form (already as they
        are stored beside the reply) and the reply's canonical JSON, each made once here."""
        key = (reply.rollout_id, reply.attempt_index)
        if key in self._tombstones or key in self._released:
            raise GoneError(f"reduced mode: try {key} was retired or released; its late reply is dropped")
        ck = capture_key(*key)
        try:
            tokens = token_records_from_reply(reply, ck, time.time())
        except (TokenRecordError, ValueError):
            tokens = []  # no usable records: the attempt is owed, never sealed (the trainer's verify says so)
        # Every number of a validated reply is one JSON carries (`GymModel`): no walk for NaN.
        payload = reply.parsed_payload()
        reply_json = canonical_bytes(payload, finite=True)
        receipt = CompletionReceipt(
            rollout_id=reply.rollout_id,
            attempt_index=reply.attempt_index,
            execution_generation=REDUCED_GENERATION,
            execution_incarnation=self.incarnation,
            result_identity=reply.id,
            result_digest=sha256_digest(reply_json),
            manifest_capture_key=ck,
            terminal_model_call_id=tokens[-1].model_call_id if tokens else "",
        )
        stored, media_type, layout = referring_entries(tokens, reply_output_of(payload))
        self._held[key] = _Held(reply, receipt, tokens)
        self._posted.pop(key, None)
        return Kept(receipt, stored, media_type, layout, reply_json)

    def replay(self, rollout_id: str, attempt_index: int) -> RunReply | None:
        held = self._held.get((rollout_id, attempt_index))
        return held.reply if held is not None else None

    def completion_receipt(self, rollout_id: str, attempt_index: int) -> CompletionReceipt:
        held = self._held.get((rollout_id, attempt_index))
        if held is None:
            raise NotFoundError(f"reduced mode: no reply held for ({rollout_id}, {attempt_index})")
        return held.receipt

    def token_capture(self, key: str) -> list[TokenEntry]:
        return list(self._held_under(key).tokens)

    def token_bytes(self, key: str) -> bytes:
        """The records held under `key` in the binary form, as `/token_capture` answers them."""
        held = self._held_under(key)
        if held.encoded is None:
            held.encoded = encode_entries(held.tokens)
        return held.encoded

    def _held_under(self, key: str) -> _Held:
        for held in self._held.values():
            if held.receipt.manifest_capture_key == key:
                return held
        raise NotFoundError(f"reduced mode: no token records held under {key!r}")

    def acknowledge(self, receipts: Sequence[CompletionReceipt]) -> list[AcknowledgeResult]:
        results = []
        for receipt in receipts:
            key = receipt.attempt
            result = AcknowledgeResult(
                rollout_id=receipt.rollout_id, attempt_index=receipt.attempt_index, acknowledged=False
            )
            held = self._held.get(key)
            if held is not None and held.receipt == receipt:
                del self._held[key]
                self._released.add(key)
                result.acknowledged = True
            elif key in self._released:
                result.acknowledged, result.idempotent = True, True
            else:
                result.error = RECEIPT_MISMATCH if held is not None else UNKNOWN_EXECUTION
            results.append(result)
        return results

    def retire(self, rollout_id: str, attempt_index: int) -> RetireResponse:
        key = (rollout_id, attempt_index)
        held = key in self._held  # completed, unacknowledged: nothing to retire
        if not held and key not in self._released:
            self._tombstones.add(key)  # its late reply is refused here
        # Released, or it reached the agent, which keeps nothing: done there.  Otherwise never sent.
        done = not held and (key in self._released or key in self._posted)
        return RetireResponse(
            retired=False,
            tombstoned=not held and not done,
            completed_unacknowledged=held,
            done=done,
            execution_generation=REDUCED_GENERATION,
            execution_incarnation=self.incarnation,
        )

    def status(self) -> AgentStatus:
        return AgentStatus(
            phase="idle",
            active_checkpoint_id=None,
            execution_generation=REDUCED_GENERATION,
            execution_incarnation=self.incarnation,
            running=0,
            park_requested=0,
            parked=0,
            completed_unacknowledged=len(self._held),
            blocking_attempts=[],
            parked_without_boundary=0,
            # Never ready: a checkpoint cannot include this agent.
            ready_to_commit=False,
            completed_attempts=[
                AttemptRef(rollout_id=rid, attempt_index=n) for rid, n in list(self._held)[:MAX_LIST_ITEMS]
            ],
        )

    def refuse_checkpoint(self, op: str, checkpoint_id: str) -> NotParticipantError:
        return NotParticipantError(
            f"{op} {checkpoint_id}: agent {self.agent_name!r} has no participant routes (reduced mode); "
            "a checkpoint cannot include it",
            status_code=None,
            error="not_participant",
        )
