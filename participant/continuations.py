"""Continuations: a try's durable state at a turn boundary, and the one decision of a resume.

A **continuation** is everything a replacement try needs to carry on from a committed turn boundary
without generating the completed model calls again: the token records so far (the model-call lineage),
the runner's own JSON state (the conversation, whatever it keeps), and the revisions of the resources
it touched.  It is stored whole, as one payload in a content-addressed `PayloadStore` (its claim is the
sha256 of its canonical JSON), so resuming costs one read, never a replay of the conversation.

The boundary is **committed** once a `committed` line naming that digest is durable in
`<state dir>/continuations.jsonl` (written after the payload: the claim-check order; each line a
checksummed record, `participant.records`).  The same file
records what was done with each continuation: `resumed` (a replacement try took it up: one try at a
time holds a lineage) and `declined` (why a try started from its prompt instead).  The index outlives
restarts: after one with the state directory kept, a retire still offers the try's latest boundary and
a replacement still resumes it; with the directory lost, a `continue-from` is declined
(`unknown_continuation`) and the try plays from its prompt, never from a guess.

`decide_resume` is the pure decision (no I/O); `ContinuationStore` does the reads and writes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from participant.durable import GroupCommitFile
from participant.records import RecordReader, cut_torn_tail, parsed_records, seal_json
from participant.states import RestartFromPrompt, resume_decision

# The payload plane's interface and its local backend, not the package (whose `open_payload_store`
# reaches the PostgreSQL and S3 backends, which the Gym side does not install).
from payloads._errors import PayloadMissing, PayloadStoreError
from payloads._local import LocalDirPayloadStore
from payloads._store import PayloadStore
from protocol import mutants
from protocol.digests import Digest, canonical_bytes, sha256_digest
from protocol.ids import AttemptIndex, Identifier
from protocol.wire import (
    ContinuationRef,
    DeclineReason,
    ResourceRevision,
    ResumeReport,
    TokenEntry,
)

CONTINUATIONS_FILE: Final = "continuations.jsonl"
PAYLOADS_DIR: Final = "payloads"
CONTINUATION_MEDIA_TYPE: Final = "application/vnd.rollout-ledger.continuation+json"

AttemptKey = tuple[str, int]


class Continuation(BaseModel):
    """What is stored at a boundary (one payload).  `tokens` are the records in their lossless form
    (every field that was set), so a resumed try hands back exactly the records the source recorded."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = 1
    rollout_id: Identifier
    lineage: Identifier
    source_attempt: AttemptIndex
    turn: int = Field(ge=1)
    prompt_digest: Digest
    tokens: list[dict[str, Any]]
    state: dict[str, Any]
    resources: list[ResourceRevision] = Field(default_factory=list)
    # The boundary before this one on the same lineage (None at the first).
    previous: Digest | None = None

    def encode(self) -> bytes:
        return canonical_bytes(self.model_dump(mode="json"))

    def token_entries(self) -> list[TokenEntry]:
        return [TokenEntry.model_validate(t) for t in self.tokens]

    def ref(self, digest: str) -> ContinuationRef:
        return ContinuationRef(
            rollout_id=self.rollout_id,
            source_attempt=self.source_attempt,
            lineage=self.lineage,
            turn=self.turn,
            digest=digest,
            prompt_digest=self.prompt_digest,
            model_call_ids=[str(t["model_call_id"]) for t in self.tokens],
            generated_tokens=sum(len(t.get("generation_token_ids", ())) for t in self.tokens),
            resources=list(self.resources),
        )


def token_record(entry: TokenEntry) -> dict[str, Any]:
    """A token record's lossless form: every field that was set, nothing added (`TokenEntry.record`)."""
    return entry.record()


# --- the index --------------------------------------------------------------------------------------

IndexKind = Literal["committed", "resumed", "declined"]


class IndexRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: IndexKind
    # The try the line is about: the one that committed the boundary, or that resumed / declined it.
    rollout_id: Identifier
    attempt_index: AttemptIndex
    digest: Digest
    execution_generation: int
    at: float
    # committed: the continuation's reference (what a retire offers).
    ref: ContinuationRef | None = None
    reason: DeclineReason | None = None


@dataclass
class ContinuationIndex:
    """The fold of continuations.jsonl, in order."""

    committed: dict[str, ContinuationRef] = field(default_factory=dict)
    # A try's latest boundary: the last it committed, else the one it resumed from.
    latest: dict[AttemptKey, str] = field(default_factory=dict)
    # The try that last took a continuation up (one try at a time holds a lineage).
    holder: dict[str, AttemptKey] = field(default_factory=dict)
    resumed: list[IndexRecord] = field(default_factory=list)
    declined: list[IndexRecord] = field(default_factory=list)
    torn_lines: int = 0
    # A try's furthest committed boundary (turns done), and the continuation it resumed, if it did.
    reached: dict[AttemptKey, int] = field(default_factory=dict)
    started_from: dict[AttemptKey, str] = field(default_factory=dict)
    # A lineage's furthest committed boundary: (turn, digest).  An earlier boundary of it is
    # superseded: resuming it would generate the turns after it on the lineage again.
    furthest: dict[str, tuple[int, str]] = field(default_factory=dict)

    def apply(self, rec: IndexRecord) -> None:
        key = (rec.rollout_id, rec.attempt_index)
        if rec.kind == "committed" and rec.ref is not None:
            self.committed[rec.digest] = rec.ref
            self.latest[key] = rec.digest
            self.holder[rec.digest] = key
            self.reached[key] = max(self.reached.get(key, 0), rec.ref.turn)
            if rec.ref.turn > self.furthest.get(rec.ref.lineage, (0, ""))[0]:
                self.furthest[rec.ref.lineage] = (rec.ref.turn, rec.digest)
        elif rec.kind == "resumed":
            self.holder[rec.digest] = key
            self.latest.setdefault(key, rec.digest)
            self.resumed.append(rec)
            self.started_from[key] = rec.digest
        elif rec.kind == "declined":
            self.declined.append(rec)

    def offer(self, rollout_id: str, attempt_index: int) -> ContinuationRef | None:
        digest = self.latest.get((rollout_id, attempt_index))
        return self.committed.get(digest) if digest is not None else None


@dataclass(frozen=True)
class TurnFigures:
    """What turn-level resume saved on one agent, from its index alone (durable evidence, in order).

    `turns_resumed`: completed turns replacement tries carried on from instead of generating them
    again; `model_tokens_saved`: the generated tokens of those turns; `turns_redone`: completed turns
    (committed boundaries of an earlier try of the rollout) that a later try generated again, as far
    as that try committed boundaries of its own."""

    turns_resumed: int = 0
    turns_redone: int = 0
    model_tokens_saved: int = 0
    resumes: int = 0
    declines: int = 0

    def __add__(self, other: TurnFigures) -> TurnFigures:
        return TurnFigures(
            self.turns_resumed + other.turns_resumed,
            self.turns_redone + other.turns_redone,
            self.model_tokens_saved + other.model_tokens_saved,
            self.resumes + other.resumes,
            self.declines + other.declines,
        )


def turn_figures(index: ContinuationIndex) -> TurnFigures:
    """Per rollout, its tries in order: a try starts at the turn of the continuation it resumed (0:
    its prompt); the turns between there and the furthest boundary an earlier try reached, up to the
    furthest it reached itself, were done twice."""
    tries: dict[str, set[int]] = {}
    for rid, n in (*index.reached, *index.started_from):
        tries.setdefault(rid, set()).add(n)
    resumed = redone = saved = 0
    for rid, attempts in tries.items():
        furthest = 0
        for n in sorted(attempts):
            source = index.committed.get(index.started_from.get((rid, n), ""))
            start = source.turn if source is not None else 0
            if source is not None:
                resumed += start
                saved += source.generated_tokens
            reached = max(index.reached.get((rid, n), 0), start)
            redone += max(0, min(furthest, reached) - start)
            furthest = max(furthest, reached)
    return TurnFigures(resumed, redone, saved, len(index.resumed), len(index.declined))


# How every index record began before records carried a checksum (`participant.records`).
_LEGACY_STARTS: Final = (b'{"kind"',)


def _read_index(path: Path) -> tuple[ContinuationIndex, RecordReader]:
    index = ContinuationIndex()
    reader = RecordReader(path, _LEGACY_STARTS)
    for _, rec in parsed_records(reader, IndexRecord.model_validate_json):
        index.apply(rec)
    index.torn_lines = len(reader.legacy_torn) + reader.torn_tail
    return index, reader


def read_index(state_dir: Path) -> ContinuationIndex:
    """Folds `<state dir>/continuations.jsonl` (absent: no continuations).  Torn lines are skipped and
    counted; a damaged record is `FileDamaged` (`participant.records`)."""
    return _read_index(Path(state_dir) / CONTINUATIONS_FILE)[0]


# --- the decision -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Declined:
    reason: DeclineReason
    detail: str = ""


def decide_resume(
    digest: str,
    *,
    rollout_id: str,
    prompt_digest: str,
    index: ContinuationIndex,
    live: Collection[AttemptKey],
) -> ContinuationRef | Declined:
    """Whether a try of `rollout_id` whose row digests to `prompt_digest` may resume continuation
    `digest`, from what the index holds and which tries are live here.  The bytes are checked after
    (one read): a continuation that passes here may still be `continuation_lost` or `_corrupt`."""
    ref = index.committed.get(digest)
    if ref is None or ref.rollout_id != rollout_id:
        return Declined("unknown_continuation", f"no committed continuation {digest} of {rollout_id}")
    holder = index.holder.get(digest)
    if holder is not None and holder in live:
        if holder == (ref.rollout_id, ref.source_attempt):
            return Declined("source_live", f"try {holder[1]} that committed it still runs here")
        return Declined("already_resumed", f"try {holder[1]} resumed it and still runs here")
    furthest = index.furthest.get(ref.lineage)
    if furthest is not None and furthest[0] > ref.turn and not mutants.active("resume_superseded_boundary"):
        return Declined(
            "superseded", f"lineage {ref.lineage} was carried on to turn {furthest[0]} ({furthest[1]})"
        )
    if ref.prompt_digest != prompt_digest:
        return Declined("prompt_mismatch", f"the lineage began from {ref.prompt_digest}")
    decided = resume_decision(ref.resources)
    if isinstance(decided, RestartFromPrompt):
        return Declined("restart_only_resource", decided.reason)
    return ref


def declined_report(digest: str, declined: Declined) -> ResumeReport:
    return ResumeReport(
        continuation=digest, outcome="declined", reason=declined.reason, detail=declined.detail[:500]
    )


def resumed_report(ref: ContinuationRef, restored: list[ResourceRevision]) -> ResumeReport:
    return ResumeReport(
        continuation=ref.digest,
        outcome="resumed",
        source_attempt=ref.source_attempt,
        lineage=ref.lineage,
        turn=ref.turn,
        reused_model_calls=list(ref.model_call_ids),
        reused_tokens=ref.generated_tokens,
        restored=restored,
        prompt_digest=ref.prompt_digest,
    )


# --- the store --------------------------------------------------------------------------------------


class ContinuationReadError(Exception):
    def __init__(self, reason: DeclineReason, detail: str) -> None:
        super().__init__(detail)
        self.reason: DeclineReason = reason
        self.detail = detail


def check_continuation(ref: ContinuationRef, content: bytes) -> Continuation:
    """The continuation in `content`, if it is the one `ref` names: its bytes hash to the digest and it
    is what the index committed (same rollout, lineage, try and turn); else `continuation_corrupt`."""
    if sha256_digest(content) != ref.digest:
        raise ContinuationReadError("continuation_corrupt", f"{ref.digest}: the bytes do not hash to it")
    try:
        continuation = Continuation.model_validate_json(content)
        tokens = continuation.token_entries()
    except (ValueError, ValidationError) as exc:
        raise ContinuationReadError("continuation_corrupt", f"{ref.digest}: {exc}"[:300]) from None
    if continuation.ref(ref.digest) != ref or len(tokens) != len(ref.model_call_ids):
        raise ContinuationReadError("continuation_corrupt", f"{ref.digest} is not what was committed")
    return continuation


class ContinuationStore:
    """Continuations of one agent process: payloads in `payloads` (by default a local directory
    under the state directory), the index in continuations.jsonl (group commit: lines appended while
    a write is in flight go out in the next one, one fsync for all)."""

    def __init__(self, state_dir: Path, generation: int, payloads: PayloadStore | None = None) -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        self.payloads = payloads if payloads is not None else LocalDirPayloadStore(state_dir / PAYLOADS_DIR)
        self.path = state_dir / CONTINUATIONS_FILE
        self.generation = generation
        # A damaged index refuses this start (FileDamaged); a torn last line is cut off, so the next
        # record starts a line of its own.
        self.index, reader = _read_index(self.path)
        cut_torn_tail(reader)
        self._file = GroupCommitFile(self.path)
        self.reads = 0

    # -- writes --------------------------------------------------------------------------------------

    async def commit(self, continuation: Continuation, attempt_index: int) -> ContinuationRef:
        """Stores the continuation, then makes its boundary committed (durable on return)."""
        content = continuation.encode()
        digest = sha256_digest(content)
        await asyncio.to_thread(self.payloads.put, digest, content)
        ref = continuation.ref(digest)
        await self._append(self._line("committed", continuation.rollout_id, attempt_index, digest, ref=ref))
        return ref

    async def record_resumed(self, ref: ContinuationRef, rollout_id: str, attempt_index: int) -> None:
        await self._append(self._line("resumed", rollout_id, attempt_index, ref.digest))

    async def record_declined(
        self, digest: str, rollout_id: str, attempt_index: int, reason: DeclineReason
    ) -> None:
        await self._append(self._line("declined", rollout_id, attempt_index, digest, reason=reason))

    def _line(
        self,
        kind: IndexKind,
        rollout_id: str,
        attempt_index: int,
        digest: str,
        *,
        ref: ContinuationRef | None = None,
        reason: DeclineReason | None = None,
    ) -> IndexRecord:
        return IndexRecord(
            kind=kind,
            rollout_id=rollout_id,
            attempt_index=attempt_index,
            digest=digest,
            execution_generation=self.generation,
            at=time.time(),
            ref=ref,
            reason=reason,
        )

    async def _append(self, rec: IndexRecord) -> None:
        # Applied to the fold first (the registry's decisions see it at once), durable on return.
        self.index.apply(rec)
        await self._file.commit(seal_json(rec.model_dump_json(exclude_none=True)))

    # -- reads ---------------------------------------------------------------------------------------

    def read(self, ref: ContinuationRef) -> Continuation:
        """The continuation `ref` names, checked: its bytes hash to the digest and it is the one the
        index committed (same rollout, lineage, try and turn).  One read of the payload store."""
        self.reads += 1
        try:
            content = self.payloads.get(ref.digest)
        except PayloadMissing:
            raise ContinuationReadError(
                "continuation_lost", f"{ref.digest} is not in the payload store"
            ) from None
        except PayloadStoreError as exc:
            raise ContinuationReadError("continuation_lost", f"{ref.digest}: {exc}") from None
        return check_continuation(ref, content)

    def close(self) -> None:
        self._file.close()
