"""Sealed tries for the worker tests, built the way the reference agent and the trainer build them.

Token records come from `gym_agent.episode.Environment.play`, the reference agent's own episode code
(same policy, same sampling, same logprob formula), and reach the log the way the trainer stores them:
the binary form as a payload the receipt claims, stored before the group's events; or, with
`legacy=True`, the way logs written before claims hold them (the canonical JSON list in the log's blob
table, in the same transaction, a receipt without a claim).  Nothing here depends on the coordinator.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from eventstore import EventStore
from eventstore.events import (
    AttemptMinted,
    Event,
    GroupReserved,
    GroupSealed,
    PromptRef,
    RolloutReceipt,
    SiblingSealed,
)
from eventstore.payload_stores import payload_plane
from gym_agent.episode import Environment
from gym_agent.faults import NO_FAULT
from payloads import PayloadClaim
from protocol.digests import canonical_json
from protocol.ids import capture_key
from protocol.streams import group_stream
from protocol.token_codec import TOKENS_JSON_MEDIA_TYPE, TOKENS_MEDIA_TYPE, encode_entries
from protocol.wire import AttemptRef, RunRequest, TokenEntry
from workers.policy import Policy

AGENT = "agent-a"


@dataclass(frozen=True)
class SealedTry:
    rollout_id: str
    attempt_index: int
    records: list[TokenEntry]
    receipt: RolloutReceipt
    blob: bytes
    media_type: str = TOKENS_MEDIA_TYPE
    # What goes into the store under the receipt's digest: the blob, unless a test damaged it (None:
    # nothing is stored).
    stored: bytes | None = None

    @property
    def generation_log_probs(self) -> list[float]:
        return [v for r in self.records for v in r.generation_log_probs]


def records_blob(records: list[TokenEntry], legacy: bool = False) -> bytes:
    """Exactly what the trainer stores: the binary form (or, `legacy`, the JSON list older logs hold)."""
    if legacy:
        return canonical_json([r.record() for r in records]).encode()
    return encode_entries(records)


def receipt_for(
    rollout_id: str, attempt_index: int, records: list[TokenEntry], blob: bytes
) -> RolloutReceipt:
    return RolloutReceipt(
        rollout_id=rollout_id,
        attempt_index=attempt_index,
        capture_key=capture_key(rollout_id, attempt_index),
        model_call_ids=[r.model_call_id for r in records],
        terminal_model_call_id=records[-1].model_call_id,
        token_count=sum(len(r.generation_token_ids) for r in records),
        tokens_digest="sha256:" + hashlib.sha256(blob).hexdigest(),
        reward=0.5,
        mask_sample=False,
    )


def agent_records(
    policy: Policy,
    tries: list[tuple[str, int]],
    *,
    seed: int = 0,
    turns: tuple[int, int] = (1, 3),
    temperature: float = 1.0,
) -> list[list[TokenEntry]]:
    """The token records a reference agent with this policy captures for each try."""

    async def noop() -> None:
        return None

    async def play_all(env: Environment) -> list[list[TokenEntry]]:
        out = []
        for rollout_id, attempt_index in tries:
            records: list[TokenEntry] = []
            request = RunRequest(
                rollout_id=rollout_id,
                attempt_index=attempt_index,
                sample_id=rollout_id.rpartition("_g")[0],
            )
            await env.play(request, fault=NO_FAULT, at_boundary=noop, record=records.append)
            out.append(records)
        return out

    with ThreadPoolExecutor(max_workers=1) as executor:
        env = Environment(policy, executor, seed=seed, turns=turns, temperature=temperature)
        return asyncio.run(play_all(env))


Tamper = Callable[[SealedTry], SealedTry]


def seal_group(
    store: EventStore,
    policy: Policy,
    group_id: str,
    siblings: int,
    *,
    tamper: dict[int, Tamper] | None = None,
    temperature: float = 1.0,
    legacy: bool = False,
) -> list[SealedTry]:
    """Reserves, mints and seals a group in one append, its token records stored first (or, `legacy`,
    in the log's blob table in the same transaction).

    `tamper[i]` rewrites sibling i's records/receipt/blob before anything is written.
    """
    plane = payload_plane(store)
    ids = [(f"{group_id}_g{i}", 0) for i in range(siblings)]
    made = []
    for (rollout_id, attempt_index), records in zip(
        ids, agent_records(policy, ids, temperature=temperature), strict=True
    ):
        blob = records_blob(records, legacy)
        receipt = receipt_for(rollout_id, attempt_index, records, blob)
        if not legacy:
            receipt = receipt.model_copy(
                update={"tokens": PayloadClaim.of(blob, TOKENS_MEDIA_TYPE, plane.default.name)}
            )
        media = TOKENS_JSON_MEDIA_TYPE if legacy else TOKENS_MEDIA_TYPE
        sealed = SealedTry(rollout_id, attempt_index, records, receipt, blob, media)
        made.append(sealed)
    for i, change in (tamper or {}).items():
        made[i] = change(made[i])
    events: list[Event] = [
        GroupReserved(
            group_id=group_id,
            prompt_ref=PromptRef(sample_id=group_id, task_name="tiny"),
            agent_name=AGENT,
            expected_generations=siblings,
            mode="sibling",
        )
    ]
    events += [AttemptMinted(rollout_id=t.rollout_id, generation_index=i) for i, t in enumerate(made)]
    events += [
        SiblingSealed(rollout_id=t.rollout_id, attempt_index=t.attempt_index, reward=0.5, receipt=t.receipt)
        for t in made
    ]
    events.append(
        GroupSealed(
            group_id=group_id, attempts=[AttemptRef(rollout_id=t.rollout_id, attempt_index=0) for t in made]
        )
    )
    if not legacy:  # as the trainer does it: the payloads durable before the events that claim them
        plane.default.put_many(
            {
                t.receipt.tokens_digest: t.blob if t.stored is None else t.stored
                for t in made
                if t.stored != b""
            }
        )
    with store.transaction() as tx:
        if legacy:
            for t in made:
                tx.put_blob(t.blob)
        tx.append(group_stream(group_id), events)
    return made


def with_receipt(sealed: SealedTry, **changes: object) -> SealedTry:
    return replace(sealed, receipt=sealed.receipt.model_copy(update=changes))


def with_tokens_digest(sealed: SealedTry, digest: str) -> SealedTry:
    """The receipt claims records under `digest`, where nothing is stored."""
    receipt = sealed.receipt
    claim = receipt.tokens.model_copy(update={"digest": digest}) if receipt.tokens is not None else None
    return replace(
        sealed, receipt=receipt.model_copy(update={"tokens_digest": digest, "tokens": claim}), stored=b""
    )
