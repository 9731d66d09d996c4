"""Builds logs for the projection tests by appending catalogue events through the store.

Each helper appends what the coordinator appends at that step, in the same
atomic groupings (docs/events.md, Atomic appends); tests that need a
broken log append raw events with `append`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from eventstore import EventStore
from eventstore.events import (
    AckAccepted,
    AckOwed,
    AckRejected,
    AttemptAdopted,
    AttemptMinted,
    AttemptRetired,
    CheckpointAborted,
    CheckpointCommitted,
    CheckpointParticipantFinished,
    CheckpointPrepareStarted,
    CheckpointResumed,
    Event,
    GroupAbandoned,
    GroupClaimedForTraining,
    GroupDeadLettered,
    GroupReserved,
    GroupSealed,
    LogprobsComputed,
    PromptRef,
    ReceiptFetched,
    ReplacementMinted,
    RolloutReceipt,
    RunDispatched,
    RunFailed,
    RunReplied,
    SiblingHeld,
    SiblingSealed,
    TrainerRestored,
)
from payloads import LOG_BLOBS_STORE, PayloadPlane
from payloads.replies import REPLY_MEDIA_TYPE
from projections.payload_audit import CLAIMS_OF
from protocol.digests import canonical_bytes, sha256_digest
from protocol.ids import capture_key
from protocol.streams import checkpoint_stream, group_stream, logprobs_stream, trainer_stream
from protocol.wire import AttemptRef, CompletionReceipt

AGENT = "agent-a"


def group_of(rollout_id: str) -> str:
    return rollout_id.rpartition("_g")[0]


# The payloads the builder's events name, by digest: `LogBuilder.append` stores them in the log's blob
# table (where a trainer before claims kept them), so that `ledger audit` finds every one.
PAYLOADS: dict[str, bytes] = {}


def _payload(content: bytes) -> str:
    digest = sha256_digest(content)
    PAYLOADS[digest] = content
    return digest


TOKENS_DIGEST = _payload(canonical_bytes([{"prompt_token_ids": [1, 2], "generation_token_ids": [3]}]))
LOGPROBS_DIGEST = _payload(bytes(8))


def digest_of(rollout_id: str, attempt_index: int, reward: float = 1.0) -> str:
    """The digest of the try's reply (as `protocol.digests.reply_digest` takes it)."""
    return _payload(
        canonical_bytes({"rollout_id": rollout_id, "attempt_index": attempt_index, "reward": reward})
    )


def completion_receipt(
    rollout_id: str, attempt_index: int, digest: str | None = None, generation: int = 1
) -> CompletionReceipt:
    key = capture_key(rollout_id, attempt_index)
    return CompletionReceipt(
        rollout_id=rollout_id,
        attempt_index=attempt_index,
        execution_generation=generation,
        result_identity=f"{key}#1",
        result_digest=digest or digest_of(rollout_id, attempt_index),
        manifest_capture_key=key,
        terminal_model_call_id=f"{key}-call-3",
    )


def rollout_receipt(
    rollout_id: str, attempt_index: int, reward: float = 1.0, mask: bool = False
) -> RolloutReceipt:
    key = capture_key(rollout_id, attempt_index)
    return RolloutReceipt(
        rollout_id=rollout_id,
        attempt_index=attempt_index,
        capture_key=key,
        model_call_ids=[f"{key}-call-{i}" for i in range(1, 4)],
        terminal_model_call_id=f"{key}-call-3",
        token_count=120,
        tokens_digest=TOKENS_DIGEST,
        reward=reward,
        mask_sample=mask,
    )


class LogBuilder:
    """Appends catalogue events; every helper returns the positions it wrote."""

    def __init__(self, store: EventStore, agent: str = AGENT, payloads: PayloadPlane | None = None) -> None:
        """With `payloads`, replies are stored through that plane and their events carry the claim (as
        the trainer writes them); without, they go to the log's blob table (as before claims)."""
        self.store = store
        self.agent = agent
        self.payloads = payloads

    def append(self, stream_id: str, events: Sequence[Event]) -> list[int]:
        for event in events:
            claimed = CLAIMS_OF.get(type(event))
            for claim in claimed(event) if claimed is not None else ():
                if claim.store == LOG_BLOBS_STORE and claim.digest in PAYLOADS:
                    self.store.put_blob(PAYLOADS[claim.digest])
        return self.store.append(stream_id, list(events)).positions

    def group(self, group_id: str, events: Sequence[Event]) -> list[int]:
        return self.append(group_stream(group_id), events)

    # --- groups and tries -------------------------------------------------

    def reserve(
        self,
        group_id: str,
        generations: int = 2,
        mode: str = "sibling",
        max_tries: int = 4,
        trainer: str | None = None,
        target_level: str = "sibling",
    ) -> list[int]:
        return self.group(
            group_id,
            [
                GroupReserved(
                    group_id=group_id,
                    prompt_ref=PromptRef(sample_id=f"s-{group_id}", task_name="math"),
                    agent_name=self.agent,
                    expected_generations=generations,
                    mode=mode,
                    target_level=target_level,
                    max_tries=max_tries,
                    payload={"prompt": f"prompt of {group_id}"},
                    trainer_id=trainer,
                )
            ],
        )

    def mint(self, group_id: str, generations: int = 2) -> list[int]:
        return self.group(
            group_id,
            [AttemptMinted(rollout_id=f"{group_id}_g{i}", generation_index=i) for i in range(generations)],
        )

    def replace(
        self, rollout_id: str, attempt_index: int, reason: str = "retry", retire: str | None = None
    ) -> list[int]:
        """ReplacementMinted of `attempt_index` (old = index - 1), after an AttemptRetired when `retire` is given."""
        events: list[Event] = []
        if retire is not None:
            events.append(
                AttemptRetired(rollout_id=rollout_id, attempt_index=attempt_index - 1, outcome=retire)
            )
        events.append(
            ReplacementMinted(
                rollout_id=rollout_id,
                generation_index=int(rollout_id.rpartition("_g")[2]),
                attempt_index=attempt_index,
                replaces=attempt_index - 1,
                reason=reason,
            )
        )
        return self.group(group_of(rollout_id), events)

    def dispatch(self, rollout_id: str, attempt_index: int = 0) -> list[int]:
        return self.group(
            group_of(rollout_id),
            [
                RunDispatched(
                    rollout_id=rollout_id,
                    attempt_index=attempt_index,
                    capture_key=capture_key(rollout_id, attempt_index),
                    agent_name=self.agent,
                )
            ],
        )

    def reply(
        self, rollout_id: str, attempt_index: int = 0, reward: float = 1.0, mask: bool = False
    ) -> list[int]:
        digest = digest_of(rollout_id, attempt_index)
        claim = None
        if self.payloads is not None:
            (claim,) = self.payloads.put([(PAYLOADS[digest], REPLY_MEDIA_TYPE)])
        return self.group(
            group_of(rollout_id),
            [
                RunReplied(
                    rollout_id=rollout_id,
                    attempt_index=attempt_index,
                    reward=reward,
                    mask_sample=mask,
                    reply_digest=digest,
                    reply=claim,
                )
            ],
        )

    def fail(self, rollout_id: str, attempt_index: int = 0, kind: str = "deadline") -> list[int]:
        return self.group(
            group_of(rollout_id),
            [
                RunFailed(
                    rollout_id=rollout_id, attempt_index=attempt_index, reason=f"{kind} passed", kind=kind
                )
            ],
        )

    def seal(self, rollout_id: str, attempt_index: int = 0, reward: float = 1.0) -> list[int]:
        """Sibling mode: ReceiptFetched + SiblingSealed + AckOwed in one append."""
        receipt = completion_receipt(rollout_id, attempt_index)
        return self.group(
            group_of(rollout_id),
            [
                ReceiptFetched(agent_name=self.agent, receipt=receipt),
                SiblingSealed(
                    rollout_id=rollout_id,
                    attempt_index=attempt_index,
                    reward=reward,
                    receipt=rollout_receipt(rollout_id, attempt_index, reward),
                ),
                AckOwed(agent_name=self.agent, receipt=receipt),
            ],
        )

    def hold(self, rollout_id: str, attempt_index: int = 0, reward: float = 1.0) -> list[int]:
        """Prompt_group mode: ReceiptFetched + SiblingHeld + AckOwed in one append."""
        receipt = completion_receipt(rollout_id, attempt_index)
        return self.group(
            group_of(rollout_id),
            [
                ReceiptFetched(agent_name=self.agent, receipt=receipt),
                SiblingHeld(
                    rollout_id=rollout_id,
                    attempt_index=attempt_index,
                    receipt=rollout_receipt(rollout_id, attempt_index, reward),
                ),
                AckOwed(agent_name=self.agent, receipt=receipt),
            ],
        )

    def owe(self, rollout_id: str, attempt_index: int = 0) -> list[int]:
        """A finished try that is only ACKed (masked, or discarded with its group): ReceiptFetched + AckOwed."""
        receipt = completion_receipt(rollout_id, attempt_index)
        return self.group(
            group_of(rollout_id),
            [
                ReceiptFetched(agent_name=self.agent, receipt=receipt),
                AckOwed(agent_name=self.agent, receipt=receipt),
            ],
        )

    def seal_group(
        self, group_id: str, attempts: dict[int, int], reward: float = 1.0, held: bool = False
    ) -> list[int]:
        """GroupSealed (prompt_group: preceded by SiblingSealed x G, same append)."""
        events: list[Event] = []
        if held:
            events += [
                SiblingSealed(
                    rollout_id=f"{group_id}_g{i}",
                    attempt_index=a,
                    reward=reward,
                    receipt=rollout_receipt(f"{group_id}_g{i}", a, reward),
                )
                for i, a in sorted(attempts.items())
            ]
        refs = [
            AttemptRef(rollout_id=f"{group_id}_g{i}", attempt_index=a) for i, a in sorted(attempts.items())
        ]
        events.append(GroupSealed(group_id=group_id, attempts=refs))
        return self.group(group_id, events)

    def ack(self, rollout_id: str, attempt_index: int = 0, stream: str | None = None) -> list[int]:
        return self.append(
            stream or group_stream(group_of(rollout_id)),
            [AckAccepted(rollout_id=rollout_id, attempt_index=attempt_index, idempotent=False)],
        )

    def reject(
        self,
        rollout_id: str,
        attempt_index: int = 0,
        error: str = "unknown_execution",
        agent_generation: int | None = 1_000_000,
    ) -> list[int]:
        """By default the agent answers from a newer generation than any receipt (it restarted)."""
        return self.group(
            group_of(rollout_id),
            [
                AckRejected(
                    rollout_id=rollout_id,
                    attempt_index=attempt_index,
                    error=error,
                    agent_generation=agent_generation,
                )
            ],
        )

    def retire(
        self, rollout_id: str, attempt_index: int, outcome: str, generation: int | None = None
    ) -> list[int]:
        return self.group(
            group_of(rollout_id),
            [
                AttemptRetired(
                    rollout_id=rollout_id,
                    attempt_index=attempt_index,
                    outcome=outcome,
                    execution_generation=generation,
                )
            ],
        )

    def adopt(self, rollout_id: str, attempt_index: int) -> list[int]:
        return self.group(
            group_of(rollout_id), [AttemptAdopted(rollout_id=rollout_id, attempt_index=attempt_index)]
        )

    def abandon(self, group_id: str, attempts: dict[int, int] | None = None) -> list[int]:
        refs = [
            AttemptRef(rollout_id=f"{group_id}_g{i}", attempt_index=a)
            for i, a in sorted((attempts or {}).items())
        ]
        return self.group(
            group_id, [GroupAbandoned(group_id=group_id, reason="a sibling failed", attempts=refs)]
        )

    def dead_letter(self, group_id: str, tries: dict[int, int]) -> list[int]:
        refs = [AttemptRef(rollout_id=f"{group_id}_g{i}", attempt_index=a) for i, a in sorted(tries.items())]
        return self.group(
            group_id, [GroupDeadLettered(group_id=group_id, attempts=refs, reasons=["budget spent"])]
        )

    def claim(self, group_id: str, step: int) -> list[int]:
        return self.group(group_id, [GroupClaimedForTraining(group_id=group_id, train_step=step)])

    def logprobs(self, rollout_id: str, attempt_index: int = 0) -> list[int]:
        return self.append(
            logprobs_stream(group_of(rollout_id)),
            [
                LogprobsComputed(
                    rollout_id=rollout_id,
                    attempt_index=attempt_index,
                    policy_version="v1",
                    token_count=120,
                    logprob_sum=-12.5,
                    max_abs_diff=0.01,
                    mean_abs_diff=0.001,
                    blob_digest=LOGPROBS_DIGEST,
                )
            ],
        )

    # --- checkpoints -------------------------------------------------------

    def prepare(
        self, checkpoint_id: str, participants: list[str] | None = None, trainer: str | None = None
    ) -> list[int]:
        return self.append(
            checkpoint_stream(checkpoint_id),
            [
                CheckpointPrepareStarted(
                    checkpoint_id=checkpoint_id, participants=participants or [self.agent], trainer_id=trainer
                )
            ],
        )

    def commit(
        self,
        checkpoint_id: str,
        cut: int | None = None,
        participants: list[str] | None = None,
        trainer: str | None = None,
        carried: Sequence[tuple[str, int]] = (),
    ) -> list[int]:
        """`carried`: the finished, unACKed tries (rollout id, attempt) the prepare carried."""
        cut_position = self.store.head() if cut is None else cut
        return self.append(
            checkpoint_stream(checkpoint_id),
            [
                CheckpointCommitted(
                    checkpoint_id=checkpoint_id,
                    participants=participants or [self.agent],
                    cut_position=cut_position,
                    prepare_wait_s={self.agent: 0.25},
                    trainer_id=trainer,
                    carried={self.agent: [AttemptRef(rollout_id=r, attempt_index=n) for r, n in carried]}
                    if carried
                    else {},
                )
            ],
        )

    def resume(self, checkpoint_id: str, confirmed: bool = True) -> list[int]:
        """`confirmed`: the participant's CheckpointParticipantFinished(resumed) comes first."""
        finished = [
            CheckpointParticipantFinished(
                checkpoint_id=checkpoint_id, agent_name=self.agent, outcome="resumed"
            )
        ]
        return self.append(
            checkpoint_stream(checkpoint_id),
            [
                *(finished if confirmed else []),
                CheckpointResumed(checkpoint_id=checkpoint_id, participants=[self.agent]),
            ],
        )

    def abort(self, checkpoint_id: str) -> list[int]:
        return self.append(
            checkpoint_stream(checkpoint_id),
            [CheckpointAborted(checkpoint_id=checkpoint_id, participants=[self.agent], reason="deadline")],
        )

    def checkpoint(self, checkpoint_id: str, trainer: str | None = None) -> list[int]:
        return (
            self.prepare(checkpoint_id, trainer=trainer)
            + self.commit(checkpoint_id, trainer=trainer)
            + self.resume(checkpoint_id)
        )

    def restored(
        self,
        cut: int | None,
        checkpoint_id: str | None,
        plan: dict[str, Any] | None = None,
        trainer: str | None = None,
    ) -> list[int]:
        return self.append(
            trainer_stream(trainer),
            [
                TrainerRestored(
                    cut_position=cut, checkpoint_id=checkpoint_id, plan=plan or {}, trainer_id=trainer
                )
            ],
        )

    # --- whole histories -----------------------------------------------------

    def clean_sibling_group(
        self, group_id: str, generations: int = 2, step: int | None = None, trainer: str | None = None
    ) -> None:
        """A group that runs, seals, is ACKed (and claimed): every rule holds."""
        self.reserve(group_id, generations, trainer=trainer)
        self.mint(group_id, generations)
        for i in range(generations):
            rid = f"{group_id}_g{i}"
            self.dispatch(rid)
            self.reply(rid)
            self.seal(rid)
            self.ack(rid)
        self.seal_group(group_id, dict.fromkeys(range(generations), 0))
        if step is not None:
            self.claim(group_id, step)
