"""One rollout (a sibling) across its tries, and each try's payloads decoded.

`rollout_view` reads nothing: given the events of the sibling's streams (`console._reads`), it builds
the timeline `ledger show` draws (`projections.timeline.build_timeline`), folds the same events
through the ledger projection for each try's state, and says why each try ended.  `payloads_view`
decodes what the payload plane returned for one try, read by the claims its events carry and
checked against them (`PayloadPlane.get`): the reply (made whole where it was stored apart from its
token arrays), the token records as text with their token ids and logprobs, and the logprobs a
worker computed for the same tokens, side by side.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import orjson

from eventstore import RecordedEvent
from eventstore.events import (
    AttemptRetired,
    Event,
    LogprobsComputed,
    LogprobsRefused,
    RunReplied,
    SiblingHeld,
    SiblingSealed,
)
from payloads import PayloadClaim, PayloadStoreError
from payloads.replies import REPLY_APART_MEDIA_TYPE, put_arrays_back
from payloads.token_arrays import TokenArrays, decode_payload
from projections.base import ReplayRefused, decode
from projections.ledger import AttemptState, LedgerProjection, LedgerState
from projections.timeline import Timeline, build_timeline
from protocol.ids import group_id_of
from protocol.token_codec import TokenCodecError

# Tokens listed per try before "n more" (the page stays light for a 64k-token try).
TOKENS_SHOWN: Final = 400
# Characters of the reply's JSON shown before it is cut.
REPLY_CHARS: Final = 40_000


@dataclass(frozen=True, slots=True)
class Claims:
    """Where one try's payloads are, as its events name them."""

    reply: PayloadClaim | None = None
    reply_digest: str | None = None
    tokens: PayloadClaim | None = None
    logprobs: PayloadClaim | None = None
    policy_version: str | None = None


@dataclass(frozen=True, slots=True)
class AttemptView:
    index: int
    status: str
    ended: str  # why the try ended (or that it has not), in words
    agent: str | None
    reward: float | None
    failures: tuple[str, ...]
    retire: str | None  # the retire or adopt answer
    adopted: bool
    logprobs: str | None
    events: int
    first_position: int
    last_position: int
    claims: Claims


@dataclass(slots=True)
class RolloutView:
    rollout_id: str
    group_id: str
    timeline: Timeline
    attempts: list[AttemptView]
    turns: list[str] = field(default_factory=list)
    group_status: str | None = None
    agent: str | None = None
    trainer: str | None = None
    mode: str | None = None
    target_level: str | None = None
    prompt: str | None = None


def _decoded(events: Iterable[RecordedEvent]) -> Iterator[tuple[RecordedEvent, Event]]:
    for event in events:
        try:
            yield event, decode(event)
        except ReplayRefused:
            continue  # `ledger audit` names unreadable rows; a page shows what can be read


def ended(attempt: AttemptState | None, retired_for: str | None, group_status: str | None) -> str:
    """Why a try ended, from its state in the ledger (the same words as docs/protocol.md)."""
    if attempt is None:
        return "unknown (its minting is not in the log)"
    adopted = " (adopted: its finished result was taken, not run again)" if attempt.adopted else ""
    if attempt.status == "sealed":
        return f"sealed, reward {attempt.reward}{adopted}"
    if attempt.status == "held":
        return f"held for its group's round, reward {attempt.reward}{adopted}"
    if attempt.status == "discarded":
        return "discarded with its abandoned round"
    if attempt.status == "retired":
        cause = f" by checkpoint {retired_for}" if retired_for else ""
        if attempt.retire_cause == "stalled":
            cause = " (stalled inside a model call)"
        return f"retired{cause}: the agent answered {attempt.retire_outcome}"
    if attempt.status == "failed":
        return f"failed: {attempt.failures[-1]}" if attempt.failures else "failed"
    if group_status in ("sealed", "dead_lettered"):
        return f"left {attempt.status} when its group was {group_status.replace('_', '-')}"
    return f"in flight ({attempt.status})"


def rollout_view(rollout_id: str, events: list[RecordedEvent]) -> RolloutView | None:
    """The sibling's view from its streams' events (None: the log holds nothing about it)."""
    group_id = group_id_of(rollout_id) or rollout_id
    timeline = build_timeline(rollout_id, group_id, events)
    if not timeline.entries:
        return None
    ledger = LedgerState()
    projection = LedgerProjection()
    retired_for: dict[int, str] = {}
    claims: dict[int, dict[str, Any]] = {}
    logprobs: dict[int, str] = {}
    for event, decoded in _decoded(events):
        projection.apply(ledger, event, decoded)
        about = (getattr(decoded, "rollout_id", None), getattr(decoded, "attempt_index", None))
        if isinstance(decoded, SiblingSealed | SiblingHeld):
            about = (decoded.rollout_id, decoded.attempt_index)
        if about[0] != rollout_id or not isinstance(about[1], int):
            continue
        n = about[1]
        if isinstance(decoded, AttemptRetired) and decoded.checkpoint_id:
            retired_for[n] = decoded.checkpoint_id
        elif isinstance(decoded, RunReplied):
            claims.setdefault(n, {}).update(reply=decoded.reply_claim(), reply_digest=decoded.reply_digest)
        elif isinstance(decoded, SiblingSealed | SiblingHeld):
            claims.setdefault(n, {})["tokens"] = decoded.receipt.tokens_claim()
        elif isinstance(decoded, LogprobsComputed):
            claims.setdefault(n, {}).update(
                logprobs=decoded.logprobs_claim(), policy_version=decoded.policy_version
            )
            logprobs[n] = (
                f"policy {decoded.policy_version}: {decoded.token_count} tokens, sum {decoded.logprob_sum:.4f}, "
                f"max |diff| to the agent's {decoded.max_abs_diff:.2e}, mean {decoded.mean_abs_diff:.2e}"
            )
        elif isinstance(decoded, LogprobsRefused):
            logprobs[n] = f"refused by policy {decoded.policy_version}: {decoded.reason}"
    group = ledger.groups.get(group_id)
    sibling = group.sibling_of(rollout_id) if group is not None else None
    attempts = []
    for n in timeline.attempts():
        state = sibling.attempts.get(n) if sibling is not None else None
        entries = [e for e in timeline.entries if e.attempt == n]
        retire = None
        if state is not None and state.retire_outcome is not None:
            retire = state.retire_outcome + (f" (checkpoint {retired_for[n]})" if n in retired_for else "")
        attempts.append(
            AttemptView(
                index=n,
                status=state.status if state is not None else "unknown",
                ended=ended(state, retired_for.get(n), group.status if group is not None else None),
                agent=state.agent_name if state is not None else None,
                reward=state.reward if state is not None else None,
                failures=tuple(state.failures) if state is not None else (),
                retire=retire,
                adopted=bool(state is not None and state.adopted),
                logprobs=logprobs.get(n),
                events=len(entries),
                first_position=entries[0].position,
                last_position=entries[-1].position,
                claims=Claims(**claims.get(n, {})),
            )
        )
    turns = [c.text() for c in timeline.carried]
    turns += [
        f"try #{a} offered its boundary after turn {turn} when it was retired"
        for a, (turn, _) in sorted(timeline.offered.items())
    ]
    turns += [
        f"try #{a} declined to resume ({reason}): it played from its prompt"
        for a, (reason, _) in sorted(timeline.declined.items())
    ]
    view = RolloutView(rollout_id, group_id, timeline, attempts, turns)
    if group is not None:
        view.group_status = group.status
        view.agent = group.agent_name
        view.trainer = group.trainer_id
        view.mode = group.mode
        view.target_level = group.target_level
        view.prompt = f"{group.prompt_ref.task_name} / {group.prompt_ref.sample_id}"
    return view


# --- payloads ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TokenRow:
    index: int
    token_id: int
    logprob: float
    worker_logprob: float | None


@dataclass(frozen=True, slots=True)
class RecordView:
    model_call_id: str
    text: str
    prompt_tokens: int
    generated_tokens: int
    tokens: tuple[TokenRow, ...]


@dataclass(slots=True)
class PayloadsView:
    rollout_id: str
    attempt: int
    claims: Claims
    reply: str | None = None
    reply_note: str | None = None
    records: list[RecordView] = field(default_factory=list)
    tokens_note: str | None = None
    logprobs_note: str | None = None
    not_shown: int = 0  # generated tokens past TOKENS_SHOWN


Read = Callable[[PayloadClaim], bytes]


def _read(read: Read, claim: PayloadClaim) -> tuple[bytes | None, str | None]:
    """The payload, checked against its claim, or why it cannot be shown."""
    try:
        return read(claim), None
    except PayloadStoreError as exc:  # missing, altered, a store this console is not given
        return None, str(exc)


def texts(value: Any) -> Iterator[str]:
    """Every `text` string inside a record's output items, in order."""
    if isinstance(value, dict):
        text = value.get("text")
        if isinstance(text, str):
            yield text
        for key, item in value.items():
            if key != "text":
                yield from texts(item)
    elif isinstance(value, list):
        for item in value:
            yield from texts(item)


def payloads_view(rollout_id: str, attempt: int, claims: Claims, read: Read) -> PayloadsView:
    """Reads and decodes one try's payloads (`read`: the plane's checked read)."""
    view = PayloadsView(rollout_id, attempt, claims)
    tokens_bytes: bytes | None = None
    if claims.tokens is not None:
        tokens_bytes, view.tokens_note = _read(read, claims.tokens)
    else:
        view.tokens_note = "no token records: the try was not sealed or held"
    reply: Any = None
    if claims.reply is not None:
        content, view.reply_note = _read(read, claims.reply)
        if content is not None:
            try:
                reply = orjson.loads(content)
                if claims.reply.media_type == REPLY_APART_MEDIA_TYPE:
                    if tokens_bytes is None:
                        view.reply_note = "stored apart from its token arrays, which cannot be read"
                    else:
                        reply = put_arrays_back(reply, tokens_bytes)
                text = orjson.dumps(reply, option=orjson.OPT_INDENT_2).decode()
                if len(text) > REPLY_CHARS:
                    view.reply_note = f"the first {REPLY_CHARS:,} of {len(text):,} characters"
                    text = text[:REPLY_CHARS]
                view.reply = text
            except (orjson.JSONDecodeError, TokenCodecError) as exc:
                view.reply_note = f"does not decode: {exc}"
    else:
        view.reply_note = "no reply kept (masked, or no reply recorded)"
    worker: list[float] | None = None
    if claims.logprobs is not None:
        content, view.logprobs_note = _read(read, claims.logprobs)
        if content is not None:
            if len(content) % 4:
                view.logprobs_note = f"{len(content)} bytes: not float32 values"
            else:
                worker = np.frombuffer(content, dtype="<f4").astype(float).tolist()
    else:
        view.logprobs_note = "no worker has scored this try"
    if tokens_bytes is not None and claims.tokens is not None:
        try:
            arrays = decode_payload(
                bytearray(tokens_bytes), claims.tokens.media_type, check_canonical=False, reply=reply
            )
            view.records, view.not_shown = _records(arrays, worker)
        except TokenCodecError as exc:
            view.tokens_note = f"token records do not decode: {exc}"
    return view


def _records(arrays: TokenArrays, worker: list[float] | None) -> tuple[list[RecordView], int]:
    out = []
    shown = 0
    offset = 0  # the worker's array runs over every record's generated tokens in order
    hidden = 0
    for r, head in enumerate(arrays.records):
        ids = arrays.generation(r)
        agent = arrays.logprobs(r)
        room = max(0, TOKENS_SHOWN - shown)
        rows = tuple(
            TokenRow(
                index=i,
                token_id=int(ids[i]),
                logprob=float(agent[i]),
                worker_logprob=worker[offset + i]
                if worker is not None and offset + i < len(worker)
                else None,
            )
            for i in range(min(room, len(ids)))
        )
        shown += len(rows)
        hidden += len(ids) - len(rows)
        offset += len(ids)
        out.append(
            RecordView(
                model_call_id=str(head.get("model_call_id")),
                text="\n".join(texts(head.get("output_items") or [])),
                prompt_tokens=int(arrays.prompt(r).size),
                generated_tokens=int(ids.size),
                tokens=rows,
            )
        )
    return out, hidden


__all__ = [
    "REPLY_CHARS",
    "TOKENS_SHOWN",
    "AttemptView",
    "Claims",
    "PayloadsView",
    "RecordView",
    "RolloutView",
    "TokenRow",
    "ended",
    "payloads_view",
    "rollout_view",
    "texts",
]
