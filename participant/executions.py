"""The execution registry: every try's state, the checkpoint phase machine and its fences.

Everything here runs on the server's event loop; a state change is a plain assignment followed by
`_notify()`, which wakes whoever waits for a condition (a prepare waiting for tries to park).  What a
try does is the `Runner`'s business (the reference agent's episode, or a wrapped Gym agent's own
`/run`); what happens to it is recorded durably in the evidence log before it counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from participant.checkpoint import ActivePrefix, AgentCheckpoint, ParkedContinuation, write_checkpoint
from participant.continuations import (
    Continuation,
    ContinuationReadError,
    ContinuationStore,
    Declined,
    decide_resume,
    declined_report,
    resumed_report,
    token_record,
)
from participant.errors import (
    CheckpointConflictError,
    CheckpointWriteError,
    ExecutionFailedError,
    GoneError,
    InvalidPhaseError,
    InvalidRequestError,
    NotFoundError,
    NotReadyError,
    RunnerFailed,
    ShuttingDownError,
    StaleCheckpointError,
)
from participant.evidence import EvidenceKind, EvidenceLog
from participant.replies import ParsedReply
from participant.states import (
    BLOCKING_STATES,
    CHECKPOINT_OPS,
    DONE_STATES,
    LIVE_STATES,
    RETIRE_PHASES,
    ExecEvent,
    ExecState,
    PhaseOp,
    RestartFromPrompt,
    next_phase,
    next_state,
    resume_decision,
)
from protocol import mutants
from protocol.digests import canonical_bytes, sha256_digest
from protocol.errors import RECEIPT_MISMATCH, UNKNOWN_EXECUTION
from protocol.ids import capture_key, mint_incarnation
from protocol.tokens import token_records_from_reply
from protocol.wire import (
    ALL_FEATURES,
    FEATURE_CARRY_COMPLETED,
    FEATURE_GENERATION_CUT,
    FEATURE_TURN_CONTINUATION,
    MAX_LIST_ITEMS,
    AcknowledgeRequest,
    AcknowledgeResult,
    AgentStatus,
    AttemptProgress,
    AttemptRef,
    AttemptWork,
    CompletionReceipt,
    ContinuationRef,
    Phase,
    PhaseResponse,
    ResourceRevision,
    ResumeReport,
    RetireRequest,
    RetireResponse,
    RunReply,
    RunRequest,
    TokenEntry,
)

log = logging.getLogger("participant")


class RunSession(Protocol):
    """What a runner may do while it plays a try.

    Every call is progress of the try's own, what a prepare judges a try by: a try that reports none
    for longer than its runner promised (`heartbeat_s`) is stuck.  A model call runs from a boundary
    (or the try's start) to its token record; time inside `at_boundary` (parked included) and between a
    record and the next boundary (a tool) is not model time."""

    async def at_boundary(self) -> None:
        """A model-call boundary: a checkpoint parks the try here until it is resumed or aborted."""

    def record(self, entry: TokenEntry) -> None:
        """Keeps one model call's token record (in call order)."""

    def heartbeat(self, generated_tokens: int | None = None) -> None:
        """The try is alive (inside a model call or a tool); `generated_tokens`: what the model call in
        progress has generated so far, when the runner knows."""

    async def at_cut(self, prefix: ActivePrefix) -> None:
        """A durable token boundary inside a model call (a generation-safe cut): when a checkpoint has
        asked the try to park, it parks here with `prefix` (the call's tokens so far) kept in the
        checkpoint's artefact, until it is resumed or aborted; otherwise it returns at once (a
        heartbeat).  The runner then goes on with the same call from `prefix`.  An agent whose runner
        cuts declares it (`mount_participant(generation_cuts=True)`)."""

    @property
    def lineage(self) -> str:
        """The conversation this try plays: the capture key of the try whose prompt began it (its own,
        unless it resumed a continuation).  Resource sessions and mutation keys are per lineage."""
        ...

    @property
    def resumed(self) -> Resumed | None:
        """The continuation this try carries on from (None: it plays from its prompt).  Its token
        records are this try's first records already (the same records, under this try's capture
        key); the runner continues after `turn`."""
        ...

    async def commit_turn(
        self, turn: int, state: dict[str, Any], resources: Sequence[ResourceRevision] = ()
    ) -> ContinuationRef | None:
        """A turn boundary: `turn` turns are done, `state` is the runner's own JSON state to carry on
        from, `resources` the resources touched so far at their revisions (exported by the runner).
        Returns once the continuation (with every token record so far) is durable; None when this agent
        keeps no continuations.  Call it before `at_boundary`, so a park finds the boundary saved."""
        ...


@dataclass(frozen=True)
class Resumed:
    """What a resumed try starts from: the continuation's turn and state, its records (reused, not
    generated again), and the resources restored at their revisions before the runner was called."""

    ref: ContinuationRef
    turn: int
    state: dict[str, Any]
    tokens: tuple[TokenEntry, ...]
    restored: tuple[ResourceRevision, ...]


# Restores export/restore resources at a continuation's revisions before a resumed try runs (raises
# when it cannot: the try then plays from its prompt).
Restorer = Callable[[Sequence[ResourceRevision]], Awaitable[None]]


class Runner(Protocol):
    """Plays one try to its reply.  A runner that records no token records leaves them to be read
    off the reply (`protocol.tokens`); one that never calls `at_boundary` cannot park mid-try, so a
    prepare waits for its tries to finish (or the trainer retires them)."""

    def __call__(self, request: RunRequest, session: RunSession) -> Awaitable[RunReply]: ...


AttemptKey = tuple[str, int]


@dataclass(frozen=True, slots=True)
class _DoneAttempt:
    """All that is kept of a try done for good (ACKNOWLEDGED or CANCELLED): enough to answer 410, an
    idempotent ACK (the receipt's digest) and its token capture key; about a tenth of an Execution."""

    state: ExecState
    receipt_digest: bytes | None


def _receipt_digest(receipt: CompletionReceipt) -> bytes:
    return hashlib.sha256(receipt.model_dump_json().encode()).digest()


@dataclass(eq=False)
class Execution:
    """One try in this process; it is also the `RunSession` its runner plays it with."""

    request: RunRequest
    capture_key: str
    # The registry's notify: a park at a boundary wakes whoever waits for tries to park.
    notify: Callable[[], None] = field(repr=False, default=lambda: None)
    state: ExecState = ExecState.RUNNING
    # The durable write of this try's `started` evidence, queued before it runs.
    started: asyncio.Future[None] | None = None
    task: asyncio.Task[None] | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    # Set while the run may proceed; cleared when a checkpoint asks it to park.
    may_run: asyncio.Event = field(default_factory=asyncio.Event)
    reply: dict[str, Any] | None = None
    # The reply's canonical JSON: what the receipt's digest is taken of, and the body it is answered
    # with (written once, not again for each delivery).
    reply_json: bytes = b""
    receipt: CompletionReceipt | None = None
    tokens: list[TokenEntry] = field(default_factory=list)
    error: str | None = None
    # Progress of its own (monotonic): its start, a boundary, a token record, a heartbeat.
    last_progress: float = field(default_factory=time.monotonic)
    # Since when it is inside a model call (None at a boundary, or in a tool after a record).
    in_call_since: float | None = field(default_factory=time.monotonic)
    model_s: float = 0.0
    recorded_tokens: int = 0
    # The model call in progress: tokens generated so far, as the runner's heartbeat said.
    call_tokens: int = 0
    # Whether the runner ever reached a boundary: one that never does goes from one record straight
    # into its next model call.
    uses_boundaries: bool = False
    # Parked at a cut inside a model call: the call's prefix (RunSession.at_cut).
    cut: ActivePrefix | None = None
    # The continuation the trainer asked this try to resume (`x-ledger-continue-from`), and what came of it.
    continue_from: str | None = None
    resume_report: ResumeReport | None = None
    resumed: Resumed | None = None
    lineage: str = ""
    # The latest boundary this try committed (or resumed from): the next one's `previous`.
    last_continuation: str | None = None
    committer: (
        Callable[
            [Execution, int, dict[str, Any], Sequence[ResourceRevision]], Awaitable[ContinuationRef | None]
        ]
        | None
    ) = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.may_run.set()
        if not self.lineage:
            self.lineage = self.capture_key

    @property
    def key(self) -> AttemptKey:
        return (self.request.rollout_id, self.request.attempt_index)

    @property
    def ref(self) -> AttemptRef:
        return AttemptRef(rollout_id=self.request.rollout_id, attempt_index=self.request.attempt_index)

    @property
    def evidence(self) -> tuple[str, int, str]:
        return (self.request.rollout_id, self.request.attempt_index, self.capture_key)

    def _leave_call(self, now: float) -> None:
        if self.in_call_since is not None:
            self.model_s += now - self.in_call_since
            self.in_call_since = None

    def work(self, now: float | None = None) -> AttemptWork:
        """What the try has cost so far (the model call in progress counted up to `now`)."""
        now = time.monotonic() if now is None else now
        running = now - self.in_call_since if self.in_call_since is not None else 0.0
        return AttemptWork(
            model_s=round(self.model_s + running, 6),
            generated_tokens=self.recorded_tokens + self.call_tokens,
        )

    def progress(self, now: float) -> AttemptProgress:
        return AttemptProgress(
            rollout_id=self.request.rollout_id,
            attempt_index=self.request.attempt_index,
            model_calls_done=len(self.tokens),
            work=self.work(now),
            since_progress_s=round(max(0.0, now - self.last_progress), 4),
            in_model_call=self.in_call_since is not None,
        )

    def move(self, event: ExecEvent) -> None:
        """The try's next state, as `participant.states.EXEC_TRANSITIONS` has it (raises otherwise)."""
        self.state = next_state(self.state, event)

    async def at_boundary(self) -> None:
        now = time.monotonic()
        self._leave_call(now)
        self.uses_boundaries = True
        self.last_progress = now
        parking = self.state is ExecState.PARK_REQUESTED
        self.move(ExecEvent.BOUNDARY)
        if parking:
            self.notify()
        # Whoever clears the park (resume, abort) sets the state back to RUNNING before waking us.
        await self.may_run.wait()
        self.in_call_since = self.last_progress = time.monotonic()

    def record(self, entry: TokenEntry) -> None:
        now = time.monotonic()
        self._leave_call(now)
        self.tokens.append(entry)
        self.recorded_tokens += len(entry.generation_token_ids)
        self.call_tokens = 0
        self.last_progress = now
        if not self.uses_boundaries:
            self.in_call_since = now

    async def at_cut(self, prefix: ActivePrefix) -> None:
        self.heartbeat(len(prefix.generation_token_ids))
        if self.state is not ExecState.PARK_REQUESTED:
            return
        # Parked time is not model time: the call is left and entered again after the park.
        self._leave_call(time.monotonic())
        self.cut = prefix
        self.move(ExecEvent.BOUNDARY)
        self.notify()
        try:
            await self.may_run.wait()
        finally:
            self.cut = None
        self.in_call_since = self.last_progress = time.monotonic()

    async def park_at_end(self) -> None:
        """The end of the run is a boundary too: a try whose last call ends while a checkpoint asks it
        to park parks here, its reply held (not yet recorded or sent) until the resume or abort.  So
        a prepare waits for the calls in flight and for nothing else: the results of tries that end
        meanwhile go to the trainer after the decision, not in a burst it must take in (record and
        ACK) before the agent can be ready.  Nothing of the try's work is at risk: a retire of a
        parked try cancels it, as one parked before its last call."""
        if self.state is not ExecState.PARK_REQUESTED:
            return
        now = time.monotonic()
        self._leave_call(now)
        self.last_progress = now
        self.move(ExecEvent.BOUNDARY)
        self.notify()
        await self.may_run.wait()
        self.last_progress = time.monotonic()

    def heartbeat(self, generated_tokens: int | None = None) -> None:
        self.last_progress = time.monotonic()
        if generated_tokens is not None:
            self.call_tokens = max(0, generated_tokens)

    async def commit_turn(
        self, turn: int, state: dict[str, Any], resources: Sequence[ResourceRevision] = ()
    ) -> ContinuationRef | None:
        self._leave_call(time.monotonic())
        self.last_progress = time.monotonic()
        if self.committer is None:
            return None
        return await self.committer(self, turn, state, resources)


@dataclass(frozen=True)
class RunOutcome:
    reply: dict[str, Any]
    # True when this call waited for the try to finish (a live delivery), False for a replay of a
    # reply already stored; the reference agent's drop_reply fault breaks off live deliveries only.
    live: bool
    # The try's receipt and token records, for an answer that carries them (protocol.completion).
    receipt: CompletionReceipt | None = None
    tokens: Sequence[TokenEntry] = ()
    # `reply` as canonical JSON, the body a delivery answers (its digest the receipt's).
    reply_json: bytes = b""


def _log_write_failure(done: asyncio.Future[None]) -> None:
    if not done.cancelled() and done.exception() is not None:
        log.error("could not record an execution's start", exc_info=done.exception())


class Hooks:
    """Extension points for a host that injects faults (the reference agent); these do nothing."""

    def started(self, request: RunRequest) -> None:
        """A try is about to start executing (its `started` evidence is queued)."""

    def completed(self, request: RunRequest) -> None:
        """A try completed (its `started` and `completed` evidence are durable)."""


class ExecutionRegistry:
    def __init__(
        self,
        *,
        agent_name: str,
        generation: int,
        runner: Runner,
        state_dir: Path,
        hooks: Hooks | None = None,
        heartbeat_s: float | None = None,
        continuations: ContinuationStore | None = None,
        generation_cuts: bool = False,
        restorer: Restorer | None = None,
        incarnation: str | None = None,
    ) -> None:
        if heartbeat_s is not None and not heartbeat_s > 0:
            raise ValueError(f"heartbeat_s must be > 0 (or None), got {heartbeat_s}")
        self.agent_name = agent_name
        # The runner's promise: the longest it goes without progress of a live try (RunSession).
        self.heartbeat_s = heartbeat_s
        self.generation = generation
        # This process's identity for the trainer (`participant.generation`): minted here when the
        # caller took none from the state directory.
        self.incarnation = incarnation if incarnation is not None else mint_incarnation()
        self.runner = runner
        self.state_dir = state_dir
        self.hooks = hooks if hooks is not None else Hooks()
        self.evidence = EvidenceLog(state_dir, generation)
        # Turn-level resume (None: this agent keeps no continuations, a continue-from is declined).
        self.continuations = continuations
        # The runner cuts model calls at durable token boundaries (RunSession.at_cut): declared.
        self.generation_cuts = generation_cuts
        self.restorer = restorer
        # Continuations a try is taking up right now (read, restore): one try at a time.
        self._taking: set[str] = set()
        self._executions: dict[AttemptKey, Execution] = {}
        # Attempts not yet done for good: what status and checkpoints look at, so their cost follows the
        # tries in play, not every try the agent ever ran.  Pruned lazily by `_in_state`.
        self._active: dict[AttemptKey, Execution] = {}
        self._by_capture_key: dict[str, AttemptKey] = {}  # every try ever started (capture keys never reused)
        # Attempts done for good, compacted: the agent's memory per finished try stays small.
        self._done: dict[AttemptKey, _DoneAttempt] = {}
        self._tombstones: set[AttemptKey] = set()
        self._runs: dict[str, int] = {}
        self.phase: Phase = "idle"
        self.active_checkpoint: str | None = None
        self._finished: dict[str, str] = {}
        self._admission = asyncio.Event()
        self._admission.set()
        self._changed = asyncio.Event()
        self._closing = False

    # -- bookkeeping -----------------------------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_until(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            await self._changed.wait()

    def _in_state(self, *states: ExecState) -> list[Execution]:
        done = [k for k, e in self._active.items() if e.state in DONE_STATES]
        for key in done:
            del self._active[key]
        return sorted((e for e in self._active.values() if e.state in states), key=lambda e: e.key)

    def _is_done_for_good(self, key: AttemptKey) -> bool:
        # An earlier process's try is done for good here, whatever it was: retired, acknowledged, or
        # finished or started (its result and its run went with that process; running it again would
        # execute it twice, and a stale trainer's late /run must not start a try the log replaced).
        if mutants.active("agent_forgets_tombstones"):
            return key in self._tombstones or key in self._done
        return key in self._tombstones or key in self._done or key in self.evidence.earlier

    def _forget(self, ex: Execution, event: ExecEvent) -> None:
        """`ex` is done for good: keep only its compact record (a task still running it holds its own)."""
        ex.move(event)
        state = ex.state
        ex.reply, ex.reply_json, ex.tokens = None, b"", []
        if self._executions.get(ex.key) is ex:
            del self._executions[ex.key]
            self._active.pop(ex.key, None)
            digest = _receipt_digest(ex.receipt) if ex.receipt is not None else None
            self._done[ex.key] = _DoneAttempt(state, digest)

    def _check_open(self) -> None:
        if self._closing:
            raise ShuttingDownError("agent is shutting down")

    # -- runs ------------------------------------------------------------------------------------

    def features(self) -> list[str]:
        """What `/capabilities` declares."""
        extra = [FEATURE_CARRY_COMPLETED]
        if self.continuations is not None:
            extra.append(FEATURE_TURN_CONTINUATION)
        if self.generation_cuts:
            extra.append(FEATURE_GENERATION_CUT)
        return [*ALL_FEATURES, *extra]

    async def run(
        self, request: RunRequest, *, adopt_only: bool = False, continue_from: str | None = None
    ) -> RunOutcome:
        """Starts the try, or joins/replays the execution this process already has of it.  An
        adopt-only call never starts one: without a record of the try it answers 404.  A new try
        with `continue_from` (a continuation's digest) resumes it, or declines and plays from its
        prompt (`ResumeReport` in its receipt)."""
        key = (request.rollout_id, request.attempt_index)
        while True:
            self._check_open()
            if self._is_done_for_good(key):
                raise GoneError(
                    f"try {key} is done for good (acknowledged, retired or tombstoned, or recorded by an "
                    "earlier process of this agent)"
                )
            existing = self._executions.get(key)
            if existing is not None:
                # A finished try is replayed here, before (and regardless of) the admission check.
                return await self._join(existing)
            if adopt_only:
                raise NotFoundError(
                    f"no record of try {key} in execution generation {self.generation}; "
                    "an adopt-only call never starts it"
                )
            if self._admission.is_set():
                break
            await self._admission.wait()
        return await self._join(self._start(request, continue_from))

    def _start(self, request: RunRequest, continue_from: str | None = None) -> Execution:
        key = (request.rollout_id, request.attempt_index)
        ck = capture_key(*key)
        owner = self._by_capture_key.get(ck)
        if owner is not None and owner != key:
            raise InvalidRequestError(f"capture key '{ck}' of try {key} collides with try {owner}")
        ex = Execution(
            request=request,
            capture_key=ck,
            notify=self._notify,
            continue_from=continue_from,
            committer=self._commit_turn if self.continuations is not None else None,
        )
        # Queued before the try runs (in order: no later record of it can be written first), and
        # awaited before its result leaves; the runner does not wait for the disk.
        ex.started = self.evidence.append("started", [ex.evidence])
        ex.started.add_done_callback(_log_write_failure)
        self.hooks.started(request)
        self._executions[key] = ex
        self._active[key] = ex
        self._by_capture_key[ck] = key
        self._runs[ck] = self._runs.get(ck, 0) + 1
        ex.task = asyncio.create_task(self._execute(ex), name=f"run:{ck}")
        self._notify()
        return ex

    async def _join(self, ex: Execution) -> RunOutcome:
        if ex.state is ExecState.COMPLETED and ex.reply is not None:
            return RunOutcome(ex.reply, False, ex.receipt, ex.tokens, ex.reply_json)
        if ex.state in LIVE_STATES:
            await ex.done.wait()
            self._check_open()
            if ex.state is ExecState.COMPLETED and ex.reply is not None:
                return RunOutcome(ex.reply, True, ex.receipt, ex.tokens, ex.reply_json)
        if ex.state is ExecState.FAILED:
            raise ExecutionFailedError(f"try {ex.key} failed inside the agent: {ex.error}")
        raise GoneError(f"try {ex.key} is done for good ({ex.state.value.lower()})")

    async def _execute(self, ex: Execution) -> None:
        try:
            if ex.continue_from is not None:
                await self._take_up(ex, ex.continue_from)
            reply = await self.runner(ex.request, ex)
            if (reply.rollout_id, reply.attempt_index) != ex.key:
                raise ValueError(f"the runner answered for ({reply.rollout_id}, {reply.attempt_index})")
            await ex.park_at_end()
            ex._leave_call(time.monotonic())
            if not ex.tokens:
                # A runner that does not capture call by call: read the records off the reply.
                ex.tokens = token_records_from_reply(reply, ex.capture_key, time.time())
                ex.recorded_tokens = sum(len(t.generation_token_ids) for t in ex.tokens)
            if isinstance(reply, ParsedReply):  # parsed here, validated: shared, not copied (replies.py)
                ex.reply = reply.parsed_payload()
                ex.reply_json = canonical_bytes(ex.reply, finite=True)
            else:
                ex.reply = reply.payload()
                ex.reply_json = canonical_bytes(ex.reply)
            ex.receipt = CompletionReceipt(
                rollout_id=ex.request.rollout_id,
                attempt_index=ex.request.attempt_index,
                execution_generation=self.generation,
                execution_incarnation=self.incarnation,
                result_identity=reply.id,
                # `reply_digest` of the payload just written (`RunReply.digest` would write it again).
                result_digest=sha256_digest(ex.reply_json),
                manifest_capture_key=ex.capture_key,
                terminal_model_call_id=ex.tokens[-1].model_call_id if ex.tokens else "",
                work=ex.work(),
                resume=ex.resume_report,
            )
            # Both durable before anyone is given the reply or the receipt: an execution whose result
            # can leave this process is always in the evidence.
            if ex.started is not None:
                await asyncio.shield(ex.started)
            await self.evidence.commit("completed", [ex.evidence])
            ex.move(ExecEvent.COMPLETE)
            self.hooks.completed(ex.request)
        except asyncio.CancelledError:
            self._forget(ex, ExecEvent.CANCEL)
            raise
        except Exception as exc:
            if isinstance(exc, RunnerFailed):
                log.warning("try %s failed: %s", ex.key, exc)
            else:
                log.exception("try %s failed", ex.key)
            ex.move(ExecEvent.FAIL)
            ex.error = f"{type(exc).__name__}: {exc}"
            ex.done.set()
            self._notify()
            await self._record("failed", [ex])
        finally:
            ex.done.set()
            self._notify()

    # -- continuations -------------------------------------------------------------------------------

    async def _take_up(self, ex: Execution, digest: str) -> None:
        """Resumes `ex` from continuation `digest`, or declines (the try then plays from its prompt):
        one read of the continuation, a restore of its export/restore resources, and a durable
        `resumed` line, in that order, before the runner is called."""
        store = self.continuations
        if store is None:
            ex.resume_report = declined_report(digest, Declined("not_resumable", "no continuations here"))
            return
        live = {k for k, e in self._active.items() if e.state in LIVE_STATES and e is not ex}
        decided = decide_resume(
            digest,
            rollout_id=ex.request.rollout_id,
            prompt_digest=ex.request.prompt_digest(),
            index=store.index,
            live=live,
        )
        if isinstance(decided, ContinuationRef) and digest in self._taking:
            decided = Declined("already_resumed", "another try is taking it up now")
        if isinstance(decided, Declined):
            await self._decline(ex, digest, decided)
            return
        ref = decided
        self._taking.add(digest)
        try:
            try:
                continuation = await asyncio.to_thread(store.read, ref)
            except ContinuationReadError as exc:
                await self._decline(ex, digest, Declined(exc.reason, exc.detail))
                return
            restore = resume_decision(continuation.resources)
            assert not isinstance(restore, RestartFromPrompt)  # decide_resume refused those
            if restore.restore:
                try:
                    if self.restorer is None:
                        raise RuntimeError("this agent has no restorer for its resources")
                    await self.restorer(restore.restore)
                except Exception as exc:
                    log.warning("try %s: restoring %s failed: %s", ex.key, digest, exc)
                    await self._decline(
                        ex, digest, Declined("restore_failed", f"{type(exc).__name__}: {exc}")
                    )
                    return
            await store.record_resumed(ref, *ex.key)
        finally:
            self._taking.discard(digest)
        # The reused records become this try's first records, filed under its own capture key (a Gym
        # token store holds one list per capture key, and its consumer resolves lineage within it).
        tokens = tuple(
            t.model_copy(update={"rollout_id": ex.capture_key}) for t in continuation.token_entries()
        )
        ex.tokens = list(tokens)
        ex.lineage = continuation.lineage
        ex.last_continuation = digest
        ex.resumed = Resumed(ref, continuation.turn, continuation.state, tokens, restore.restore)
        ex.resume_report = resumed_report(ref, list(restore.restore))
        log.info("try %s resumed %s at turn %d (try %d)", ex.key, digest, ref.turn, ref.source_attempt)

    async def _decline(self, ex: Execution, digest: str, declined: Declined) -> None:
        ex.resume_report = declined_report(digest, declined)
        log.info("try %s declined %s: %s %s", ex.key, digest, declined.reason, declined.detail)
        if self.continuations is not None:
            await self.continuations.record_declined(digest, *ex.key, declined.reason)

    async def _commit_turn(
        self, ex: Execution, turn: int, state: dict[str, Any], resources: Sequence[ResourceRevision]
    ) -> ContinuationRef | None:
        store = self.continuations
        if store is None:
            return None
        continuation = Continuation(
            rollout_id=ex.request.rollout_id,
            lineage=ex.lineage,
            source_attempt=ex.request.attempt_index,
            turn=turn,
            prompt_digest=ex.request.prompt_digest(),
            tokens=[token_record(t) for t in ex.tokens],
            state=state,
            resources=list(resources),
            previous=ex.last_continuation,
        )
        ref = await store.commit(continuation, ex.request.attempt_index)
        ex.last_continuation = ref.digest
        return ref

    def offer(self, rollout_id: str, attempt_index: int) -> ContinuationRef | None:
        """The try's latest committed boundary (durable: also after a restart with the state kept)."""
        store = self.continuations
        return store.index.offer(rollout_id, attempt_index) if store is not None else None

    async def _record(self, kind: EvidenceKind, executions: list[Execution]) -> None:
        try:
            await self.evidence.commit(kind, [e.evidence for e in executions])
        except OSError:
            # The try's state already moved; a lost evidence line is logged loudly, never hidden.
            log.exception("could not record %s of %d tries in %s", kind, len(executions), self.evidence.path)

    # -- reads -----------------------------------------------------------------------------------

    def completion_receipt(self, rollout_id: str, attempt_index: int) -> CompletionReceipt:
        key = (rollout_id, attempt_index)
        if self._is_done_for_good(key):
            raise GoneError(f"try {key} is done for good")
        ex = self._executions.get(key)
        if ex is None or ex.state is not ExecState.COMPLETED or ex.receipt is None:
            state = "unknown" if ex is None else ex.state.value
            raise NotFoundError(f"no completion receipt for try {key} (state {state})")
        return ex.receipt

    def token_capture(self, key: str) -> list[TokenEntry]:
        owner = self._by_capture_key.get(key)
        if owner is None:
            raise NotFoundError(f"no token capture under key '{key}'")
        ex = self._executions.get(owner)
        if ex is None:
            if self._done[owner].state is ExecState.ACKNOWLEDGED:
                raise GoneError(f"the token records of '{key}' were released when the try was acknowledged")
            return []  # cancelled: its records were dropped with it
        return list(ex.tokens)

    def debug_runs(self) -> dict[str, int]:
        return dict(self._runs)

    def status(self) -> AgentStatus:
        blocking = self._in_state(*BLOCKING_STATES)
        completed = self._in_state(ExecState.COMPLETED)
        parked_without_boundary = 0  # every run of this agent parks only at a model-call boundary
        now = time.monotonic()
        return AgentStatus(
            phase=self.phase,
            active_checkpoint_id=self.active_checkpoint,
            execution_generation=self.generation,
            execution_incarnation=self.incarnation,
            running=len(self._in_state(ExecState.RUNNING)),
            park_requested=len(self._in_state(ExecState.PARK_REQUESTED)),
            parked=len(self._in_state(ExecState.PARKED)),
            completed_unacknowledged=len(completed),
            blocking_attempts=[e.ref for e in blocking],
            parked_without_boundary=parked_without_boundary,
            ready_to_commit=not blocking and not parked_without_boundary and not completed,
            heartbeat_s=self.heartbeat_s,
            progress=[e.progress(now) for e in blocking if e.state is ExecState.PARK_REQUESTED],
            completed_attempts=[e.ref for e in completed[:MAX_LIST_ITEMS]],
        )

    # -- acknowledgement and retirement ---------------------------------------------------------

    async def acknowledge(self, request: AcknowledgeRequest) -> list[AcknowledgeResult]:
        results: list[AcknowledgeResult] = []
        released: list[Execution] = []
        for item in request.executions:
            receipt = item.receipt
            ex = self._executions.get(receipt.attempt)
            done = self._done.get(receipt.attempt)
            result = AcknowledgeResult(
                rollout_id=receipt.rollout_id, attempt_index=receipt.attempt_index, acknowledged=False
            )
            if item.agent_name != self.agent_name:
                result.error = UNKNOWN_EXECUTION
            elif ex is not None and ex in released:  # named twice in one batch
                if ex.receipt == receipt:
                    result.acknowledged, result.idempotent = True, True
                else:
                    result.error = RECEIPT_MISMATCH
            elif done is not None and done.receipt_digest is not None:  # ACKNOWLEDGED before
                if done.receipt_digest == _receipt_digest(receipt):
                    result.acknowledged, result.idempotent = True, True
                else:
                    result.error = RECEIPT_MISMATCH
            elif ex is None or ex.receipt is None:
                result.error = UNKNOWN_EXECUTION
            elif ex.receipt != receipt:
                result.error = RECEIPT_MISMATCH
            else:
                # The trainer sealed its own copy of the reply and the token records before it ACKed:
                # both are released here, so a long-running agent's memory does not grow with its history.
                released.append(ex)
                result.acknowledged = True
            results.append(result)
        for ex in released:
            if ex.state is ExecState.COMPLETED:  # two items of one batch may name the same try
                self._forget(ex, ExecEvent.ACKNOWLEDGE)
        self._notify()
        # Durable before the results leave: an ACK the trainer saw accepted is in the evidence.
        await self.evidence.commit("acknowledged", [e.evidence for e in released])
        return results

    def _fence_retire(self, checkpoint_id: str | None, rollout_id: str) -> None:
        if self.phase in ("committing", "committed_paused"):
            raise InvalidPhaseError(self.phase, RETIRE_PHASES)
        active = self.active_checkpoint
        if checkpoint_id is None:
            if active is not None:
                raise CheckpointConflictError(active, self.phase, rollout_id)
        elif checkpoint_id != active:
            if checkpoint_id in self._finished:
                raise StaleCheckpointError.finished(checkpoint_id, self._finished[checkpoint_id])
            if active is not None:
                raise CheckpointConflictError(active, self.phase, rollout_id)
            raise StaleCheckpointError.unknown(checkpoint_id)

    async def retire(self, request: RetireRequest) -> RetireResponse:
        self._fence_retire(request.checkpoint_id, request.rollout_id)
        key = (request.rollout_id, request.attempt_index)
        gen = self.generation
        if self._is_done_for_good(key):
            return RetireResponse(
                retired=False,
                tombstoned=False,
                completed_unacknowledged=False,
                done=True,
                execution_generation=gen,
                continuation=self.offer(*key),
                execution_incarnation=self.incarnation,
            )
        ex = self._executions.get(key)
        if ex is not None and ex.state is ExecState.COMPLETED:
            return RetireResponse(
                retired=False,
                tombstoned=False,
                completed_unacknowledged=True,
                execution_generation=gen,
                execution_incarnation=self.incarnation,
            )
        retired = ex is not None and ex.state in LIVE_STATES
        work = ex.work() if ex is not None and retired else None
        self._tombstones.add(key)
        if ex is not None and retired:
            task = ex.task
            self._forget(ex, ExecEvent.CANCEL)
            if task is not None:
                task.cancel()
            log.info("retired running try %s", key)
        self._notify()
        # Decided and applied above (nothing can slip in between); durable before the answer leaves.
        ck = capture_key(*key)
        await self.evidence.commit(
            "cancelled" if retired else "tombstoned", [(request.rollout_id, request.attempt_index, ck)]
        )
        # A FAILED try is tombstoned like a never-started one: it produced nothing to adopt.
        return RetireResponse(
            retired=retired,
            tombstoned=True,
            completed_unacknowledged=False,
            execution_generation=gen,
            work=work,
            continuation=self.offer(*key),
            resume=ex.resume_report if ex is not None else None,
            execution_incarnation=self.incarnation,
        )

    # -- checkpoint phases ------------------------------------------------------------------------

    def _fence_checkpoint(self, op: str, checkpoint_id: str) -> bool:
        """Raises the phase-fence error of `op`; False means a friendly no-op (abort of nothing)."""
        outcome = self._finished.get(checkpoint_id)
        if outcome is not None:
            if op == "abort" and outcome == "aborted":
                return False
            raise StaleCheckpointError.finished(checkpoint_id, outcome)
        active = self.active_checkpoint
        if active is None:
            if op == "prepare":
                return True
            if op == "abort":
                # Presumed abort: recovery may abort a checkpoint this agent never saw (or lost in a
                # restart); nothing is in flight, so there is nothing to undo.  It is remembered all
                # the same: a stale coordinator's prepare of it arriving later is refused (409 stale),
                # so no agent closes its admission for a checkpoint the log already aborted.
                self._finished[checkpoint_id] = "aborted"
                return False
            raise InvalidPhaseError(self.phase, CHECKPOINT_OPS[op])
        if checkpoint_id != active:
            raise CheckpointConflictError(active, self.phase, checkpoint_id)
        if self.phase not in CHECKPOINT_OPS[op]:
            raise InvalidPhaseError(self.phase, CHECKPOINT_OPS[op])
        return True

    def _phase_response(self) -> PhaseResponse:
        return PhaseResponse(phase=self.phase, status=self.status())

    async def prepare(self, checkpoint_id: str, timeout_s: float, carry: bool = False) -> PhaseResponse:
        """Parks every running try and answers `prepared` once none runs and nothing finished is
        unACKed; with `carry`, once none runs: the finished, unACKed tries are named in the answer
        and kept as they are across the checkpoint (the trainer takes them in after the decision, or
        its recovery does), so a burst of results that ended just before the prepare does not hold
        it.  Otherwise `409 not_ready` naming them."""
        self._check_open()
        self._fence_checkpoint("prepare", checkpoint_id)
        if self.active_checkpoint is None:
            self.active_checkpoint = checkpoint_id
            self._admission.clear()
            log.info("checkpoint %s: preparing, admission closed", checkpoint_id)
        self._move_phase("prepare")
        for ex in self._in_state(ExecState.RUNNING):
            ex.move(ExecEvent.PARK_REQUEST)
            ex.may_run.clear()
        self._notify()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._wait_until(lambda: not self._in_state(*BLOCKING_STATES) or self._closing)
        self._check_open()
        # An abort (or another coordinator) may have moved the phase while we waited.
        self._fence_checkpoint("prepare", checkpoint_id)
        status = self.status()
        if status.ready_to_commit:
            self._move_phase("prepared")
            return self._phase_response()
        completed = [e.ref for e in self._in_state(ExecState.COMPLETED)]
        if (
            carry
            and not status.blocking_attempts
            and not status.parked_without_boundary
            and len(completed) <= MAX_LIST_ITEMS
        ):
            self._move_phase("prepared")
            log.info(
                "checkpoint %s: prepared, carrying %d finished unACKed tries", checkpoint_id, len(completed)
            )
            return PhaseResponse(phase=self.phase, status=self.status(), carried=completed)
        self._move_phase("not_ready")
        raise NotReadyError(self.status(), completed)

    async def commit(self, checkpoint_id: str) -> PhaseResponse:
        self._fence_checkpoint("commit", checkpoint_id)
        self._move_phase("commit")
        artefact = AgentCheckpoint(
            agent_name=self.agent_name,
            checkpoint_id=checkpoint_id,
            execution_generation=self.generation,
            parked=[
                ParkedContinuation(
                    rollout_id=e.request.rollout_id,
                    attempt_index=e.request.attempt_index,
                    capture_key=e.capture_key,
                    model_calls_done=len(e.tokens),
                    active_prefix=e.cut,
                )
                for e in self._in_state(ExecState.PARKED)
            ],
        )
        try:
            path = await asyncio.to_thread(write_checkpoint, self.state_dir, artefact)
        except BaseException as exc:
            self._move_phase("write_failed")  # nothing was published: commit again, or abort
            if isinstance(exc, OSError):
                raise CheckpointWriteError(
                    f"checkpoint {checkpoint_id}: artefact not written: {exc}"
                ) from exc
            raise
        self._move_phase("committed")
        log.info("checkpoint %s: committed (%d parked) to %s", checkpoint_id, len(artefact.parked), path)
        return self._phase_response()

    def _move_phase(self, op: PhaseOp) -> None:
        """The phase's next value, as `participant.states.PHASE_TRANSITIONS` has it."""
        self.phase = next_phase(self.phase, op)
        self._notify()

    def _finish_checkpoint(self, checkpoint_id: str, op: PhaseOp) -> None:
        outcome = "resumed" if op == "resume" else "aborted"
        for ex in self._in_state(ExecState.PARKED, ExecState.PARK_REQUESTED):
            ex.move(ExecEvent.UNPARK)
            ex.may_run.set()
        self._finished[checkpoint_id] = outcome
        self._move_phase(op)
        self.active_checkpoint = None
        self._admission.set()
        self._notify()
        log.info("checkpoint %s: %s, admission open", checkpoint_id, outcome)

    def resume(self, checkpoint_id: str) -> PhaseResponse:
        self._fence_checkpoint("resume", checkpoint_id)
        self._finish_checkpoint(checkpoint_id, "resume")
        return self._phase_response()

    def abort(self, checkpoint_id: str) -> PhaseResponse:
        if self._fence_checkpoint("abort", checkpoint_id):
            self._finish_checkpoint(checkpoint_id, "abort")
        return self._phase_response()

    # -- shutdown ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Stops every run: waiting calls answer 503 and the process can exit promptly."""
        self._closing = True
        for ex in self._in_state(*LIVE_STATES):
            if ex.task is not None:
                ex.task.cancel()
        self._admission.set()
        self._notify()
