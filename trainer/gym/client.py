"""The trainer's async client of one Gym agent.

Two connection pools: `/run` calls are long and many, so they get their own pool and no default
timeout (the trainer's lease deadline governs them); control calls go through a second pool with a 60 s
default timeout, so they never queue behind open runs (docs/protocol.md, Connection pools).  Every reply is checked
against its wire model; every refusal becomes a typed exception from `trainer.gym.errors`.

The pools are `LeanTransport`s (a keep-alive HTTP/1.1 pool whose responses llhttp parses) called through
their `exchange` method: the transport errors are httpx's own, without httpx's client layer per call
(`benchmarks/gym_client.py` measures it against aiohttp's and httpx's clients; `docs/http-client.md`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, NoReturn, Self, TypeVar
from urllib.parse import quote

import httpx
import msgspec
from pydantic import BaseModel, TypeAdapter, ValidationError

from payloads.token_arrays import TokenArrays, canonical_arrays, decode_arrays
from protocol.completion import (
    COMPLETION_MEDIA_TYPE,
    CompletionFrameError,
    CompletionParts,
    decode_completion,
)
from protocol.errors import (
    CHECKPOINT_CONFLICT,
    GONE,
    INVALID_PHASE,
    NOT_READY,
    STALE_CHECKPOINT,
    TRAINER_CONFLICT,
)
from protocol.ids import capture_key
from protocol.token_codec import ARRAY_FIELDS, TOKENS_MEDIA_TYPE, TokenCodecError, encode_entries
from protocol.wire import (
    ADOPT_ONLY_HEADER,
    CONTINUE_FROM_HEADER,
    FEATURE_CARRY_COMPLETED,
    FEATURE_CHECKPOINT_PARTICIPATION,
    FEATURE_COMPLETION_IN_RUN,
    TRAINER_HEADER,
    AcknowledgeItem,
    AcknowledgeRequest,
    AcknowledgeResponse,
    AcknowledgeResult,
    AgentStatus,
    AttemptFault,
    Capabilities,
    CheckpointRequest,
    CompletionReceipt,
    CrashAfter,
    DebugRuns,
    DriverRequest,
    DriverResponse,
    Health,
    NotReadyResponse,
    OkResponse,
    PhaseResponse,
    PrepareRequest,
    RateFaults,
    RetireRequest,
    RetireResponse,
    RunReply,
    RunRequest,
    TokenEntry,
    gym_reply,
    validation_line,
)
from trainer.gym.errors import (
    AgentIdentityError,
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
    NotReadyError,
    ReceiptMismatchError,
    StaleCheckpointError,
    TrainerConflictError,
    UnauthorizedError,
)
from trainer.gym.reduced import ReducedMode
from trainer.gym.transport import LeanTransport, Reply, Timeouts, origin_of

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
log = logging.getLogger("trainer")

DEFAULT_CONTROL_TIMEOUT_S = 60.0
DEFAULT_CONNECT_TIMEOUT_S = 10.0
# Connections of the checkpoint phase pool (one checkpoint at a time: a prepare, or a commit then resume).
PHASE_CONNECTIONS = 2
# prepare waits server-side up to its own timeout_s; the HTTP call gets this much on top.
PREPARE_MARGIN_S = 15.0
_TOKEN_LIST = TypeAdapter(list[TokenEntry])
_NO_ARRAYS: dict[str, list[Any]] = {name: [] for name in ARRAY_FIELDS}


def binary_token_records(body: bytes | memoryview) -> TokenArrays:
    """A `/token_capture` body in the binary form as arrays over its canonical form (the body itself
    when it is canonical: checked, not re-encoded), each record's other fields held to TokenEntry's
    rules as the JSON form is (its arrays, checked by the codec, stand in empty: no per-token Python
    object).  TokenCodecError or pydantic's ValidationError."""
    arrays = canonical_arrays(body)
    if not arrays.resolved:
        raise TokenCodecError("token records on the wire hold their own output items (form version 1)")
    _TOKEN_LIST.validate_python([{**r, **_NO_ARRAYS} for r in arrays.records])
    return arrays


_TOKENS_MEDIA = TOKENS_MEDIA_TYPE.encode()
# The binary form first; JSON from agents that do not speak it.
_ACCEPT_TOKENS = ((b"Accept", _TOKENS_MEDIA + b", application/json;q=0.5"),)
_JSON: TypeAdapter[Any] = TypeAdapter(Any)
_COMPLETION_MEDIA = COMPLETION_MEDIA_TYPE.encode()
# A completed attempt's receipt and token records in the /run answer; its JSON alone from other agents.
_ACCEPT_COMPLETION = ((b"Accept", _COMPLETION_MEDIA + b", application/json;q=0.5"),)
_FENCE_ERRORS: dict[str, type[GymError]] = {
    CHECKPOINT_CONFLICT: CheckpointConflictError,
    INVALID_PHASE: InvalidPhaseError,
    STALE_CHECKPOINT: StaleCheckpointError,
}


_ADOPT_ONLY = ((ADOPT_ONLY_HEADER.encode(), b"1"),)


def _continue_from(digest: str | None) -> tuple[tuple[bytes, bytes], ...]:
    return () if digest is None else ((CONTINUE_FROM_HEADER.encode(), digest.encode()),)


def _media_type(reply: Reply) -> bytes:
    content_type = next((v for k, v in reply.headers if k.lower() == b"content-type"), b"")
    return content_type.split(b";")[0].strip()


@dataclass(frozen=True, slots=True)
class Completed:
    """A `/run` answered: the reply, and the attempt's receipt and token records where the answer carried
    them, each as its fetch would have answered: the checked value, or the refusal the fetch would have
    raised (`BadResponseError`); None where the answer did not carry it (fetch it)."""

    reply: RunReply
    receipt: CompletionReceipt | BadResponseError | None = None
    tokens: TokenArrays | BadResponseError | None = None
    # The reply's JSON as the completion frame carried it, where the reply validated from it writes
    # the same JSON (`RunReply.parsed_from`): when it hashes to the receipt's digest it is the reply's
    # canonical JSON, and the trainer need not write it.  None otherwise.
    reply_json: bytes | None = None

    def carried_receipt(self) -> CompletionReceipt | None:
        """The carried receipt, None if not carried; raises the refusal of one that failed its check."""
        if isinstance(self.receipt, BadResponseError):
            raise self.receipt
        return self.receipt

    def carried_tokens(self) -> TokenArrays | None:
        """The carried token records, None if not carried; raises the refusal of ones that failed."""
        if isinstance(self.tokens, BadResponseError):
            raise self.tokens
        return self.tokens


@functools.cache
def _timeouts(total_s: float | None, connect_s: float) -> Timeouts:
    connect = connect_s if total_s is None else min(total_s, connect_s)
    return Timeouts(connect=connect, read=total_s, write=total_s, pool=total_s)


@functools.cache
def _default_ssl_context() -> ssl.SSLContext:
    # Loading the CA bundle costs tens of milliseconds; one context serves every client of the process.
    return httpx.create_ssl_context()


def verify_receipt(reply: RunReply, receipt: CompletionReceipt, digest: str | None = None) -> None:
    """Raises `ReceiptMismatchError` unless `receipt` names this attempt and this exact reply (docs/protocol.md, Receipts).

    `digest`: the reply's digest where the caller has already taken it (canonical JSON of a reply is
    the trainer's largest encode: once per reply, not twice)."""
    expected = {
        "rollout_id": reply.rollout_id,
        "attempt_index": reply.attempt_index,
        "result_identity": reply.id,
        "result_digest": reply.digest() if digest is None else digest,
        "manifest_capture_key": capture_key(reply.rollout_id, reply.attempt_index),
    }
    wrong = {k: (getattr(receipt, k), v) for k, v in expected.items() if getattr(receipt, k) != v}
    if wrong:
        detail = ", ".join(f"{k}: receipt {got!r} != reply {want!r}" for k, (got, want) in wrong.items())
        raise ReceiptMismatchError(
            f"completion receipt does not match the reply of {reply.rollout_id}: {detail}"
        )


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
        self.base_url = base_url.rstrip("/")
        self.agent_name = agent_name
        url = httpx.URL(self.base_url)
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"agent URL {base_url!r} is not an http(s) URL")
        self._origin = origin_of(url)
        self._prefix = url.raw_path.rstrip(b"/")
        host = (
            url.raw_host
            if url.port in (None, self._origin[2])
            else url.raw_host + b":" + str(url.port).encode()
        )
        self._headers: list[tuple[bytes, bytes]] = [
            (b"Host", host),
            (b"Accept", b"application/json"),
            (b"User-Agent", b"ledger-gym-client"),
        ]
        if token is not None:
            self._headers.append((b"Authorization", f"Bearer {token}".encode()))
        self.control_timeout_s = control_timeout_s
        verify = ssl_context if ssl_context is not None or url.scheme != "https" else _default_ssl_context()
        self._run_timeouts = Timeouts(connect_timeout_s, run_timeout_s, run_timeout_s, run_timeout_s)
        self._control_timeouts = _timeouts(control_timeout_s, connect_timeout_s)
        self._run = LeanTransport(ssl_context=verify, max_connections=max_run_connections)
        # One slot per connection of the run pool, taken before a /run is sent: a call that holds one
        # never waits inside the transport, so `run(on_slot=...)` runs when the call has its connection.
        self._run_slots = asyncio.Semaphore(max_run_connections)
        self.runs_waiting = 0
        self._control = LeanTransport(ssl_context=verify, max_connections=max_control_connections)
        # The checkpoint's phase calls have a pool of their own: a prepare never queues behind the
        # receipts, token records and ACKs of a burst of results (it holds every agent's admission).
        self._phases = LeanTransport(ssl_context=verify, max_connections=PHASE_CONNECTIONS)
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
        """One call; returns a 200 reply (for `_parse`), raises a typed error otherwise.  Every call
        of the client but the token fetch goes through here (tests gate and break calls here)."""
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
        what = f"{method} {self.base_url}{path}"
        content = b"" if body is None else body.model_dump_json(by_alias=True).encode()
        # An extra header replaces the base one of its name (an agent reads the first Accept it gets).
        replaced = {name.lower() for name, _ in extra_headers}
        headers = [h for h in self._headers if h[0].lower() not in replaced] if replaced else [*self._headers]
        headers += [*extra_headers, (b"Content-Length", str(len(content)).encode())]
        if body is not None:
            headers.append((b"Content-Type", b"application/json"))
        if timeout_s is not None:
            timeouts = _timeouts(timeout_s, DEFAULT_CONNECT_TIMEOUT_S)
        else:
            timeouts = self._run_timeouts if pool is self._run else self._control_timeouts
        target = self._prefix + quote(path, safe="/").encode()
        try:
            reply = await pool.exchange(method, self._origin, target, headers, content, timeouts)
        except httpx.TimeoutException as exc:
            raise AgentTimeoutError(f"{what}: timed out ({type(exc).__name__})") from exc
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            raise ConnectionLostError(f"{what}: connection lost before a complete reply ({exc})") from exc
        except httpx.TransportError as exc:
            raise AgentUnavailableError(f"{what}: agent unreachable ({type(exc).__name__}: {exc})") from exc
        if reply.status == 200:
            return reply  # its body parsed and validated in one pass by `_parse`
        try:
            payload = json.loads(reply.body)
        except ValueError:
            raise BadResponseError(
                f"{what}: HTTP {reply.status} with a body that is not JSON: {bytes(reply.body[:200])!r}",
                status_code=reply.status,
            ) from None
        self._raise_refusal(what, reply.status, payload)

    @staticmethod
    def _raise_refusal(what: str, code: int, payload: Any) -> NoReturn:
        error = payload.get("error") if isinstance(payload, dict) else None
        message = payload.get("message") if isinstance(payload, dict) else None
        text = f"{what}: HTTP {code} {error or ''}: {message or payload!r}"
        if code == 409 and error == NOT_READY:
            try:
                nr = NotReadyResponse.model_validate(payload)
            except ValidationError as exc:
                raise BadResponseError(
                    f"{what}: malformed not_ready answer: {validation_line(exc, 'answer')}", status_code=code
                ) from None
            raise NotReadyError(text, status=nr.status, attempts=nr.completed_unacknowledged_attempts)
        if code == 409 and error in _FENCE_ERRORS:
            raise _FENCE_ERRORS[error](str(message), status_code=code, error=error)
        if code == 409 and error == TRAINER_CONFLICT:
            raise TrainerConflictError(str(message), status_code=code, error=error)
        cls: type[GymError]
        if code == 401:
            cls = UnauthorizedError
        elif code == 404:
            cls = NotFoundError
        elif code == 410 and error == GONE:
            cls = GoneError
        elif code in (400, 413, 422):
            cls = InvalidRequestError
        elif code >= 500:
            cls = AgentServerError
        else:
            cls = BadResponseError
        raise cls(text, status_code=code, error=error)

    def _parse(self, model: type[M], reply: Reply, what: str) -> M:
        return self._validated(model.model_validate_json, model.__name__, reply.body, what)

    def _validated(
        self, validate: Callable[[bytes | bytearray], T], name: str, body: bytes | bytearray, what: str
    ) -> T:
        """`validate(body)`: JSON decoding and the wire model in one pass (pydantic's, in Rust)."""
        try:
            return validate(body)
        except ValidationError as exc:
            if any(error["type"] == "json_invalid" for error in exc.errors()):
                raise BadResponseError(
                    f"{self.base_url}{what}: HTTP 200 with a body that is not JSON: {bytes(body[:200])!r}",
                    status_code=200,
                ) from None
            raise BadResponseError(
                f"{self.base_url} {what}: reply fails {name}: {validation_line(exc, name)}"
            ) from None

    # -- the run pool ----------------------------------------------------------------------------------

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
        await self.connect_quietly()
        self.runs_waiting += 1
        try:
            async with asyncio.timeout(timeout_s):
                await self._run_slots.acquire()
        except TimeoutError:
            raise AgentTimeoutError(
                f"POST {self.base_url}/run: no run connection free within {timeout_s} s"
            ) from None
        finally:
            self.runs_waiting -= 1
        try:
            if on_slot is not None:
                await on_slot()
            return await self._run_holding_slot(
                request, timeout_s, adopt_only, continue_from, with_completion and self.completion_in_run
            )
        finally:
            self._run_slots.release()

    async def _run_holding_slot(
        self,
        request: RunRequest,
        timeout_s: float | None,
        adopt_only: bool,
        continue_from: str | None,
        with_completion: bool,
    ) -> Completed:
        key = (request.rollout_id, request.attempt_index)
        if self.reduced is not None:
            held = self.reduced.replay(*key)
            if held is not None:
                return Completed(held)
            if adopt_only:
                raise NotFoundError(f"{self.base_url} (reduced mode): no reply held for {key}; not re-run")
            self.reduced.posting(*key)
        try:
            answer = await self._send(
                self._run,
                "POST",
                "/run",
                body=request,
                timeout_s=timeout_s,
                extra_headers=(
                    *(_ADOPT_ONLY if adopt_only else _continue_from(continue_from)),
                    *self._trainer,
                    *(_ACCEPT_COMPLETION if with_completion else ()),
                ),
            )
        except GymError as exc:
            if self.reduced is not None:
                self.reduced.unanswered(*key, f"{type(exc).__name__}: {exc}")
            raise
        body, receipt, tokens, framed = answer.body, None, None, False
        if _media_type(answer) == _COMPLETION_MEDIA:
            try:
                parts = decode_completion(body)
            except CompletionFrameError as exc:
                raise BadResponseError(f"{self.base_url}/run: {exc}") from None
            body, framed = parts.reply, True
            receipt, tokens = self._completion_parts(parts, *key)
        payload = self._run_json(body)
        try:
            reply = gym_reply(payload, request.rollout_id, request.attempt_index)
        except ValidationError as exc:
            raise BadResponseError(
                f"{self.base_url} /run: reply fails RunReply: {validation_line(exc, 'reply')}"
            ) from None
        if (reply.rollout_id, reply.attempt_index) != key:
            raise BadResponseError(
                f"{self.base_url} /run answered for ({reply.rollout_id}, {reply.attempt_index}) "
                f"instead of ({request.rollout_id}, {request.attempt_index})"
            )
        if self.reduced is not None:
            # Carried as a participant's frame would carry them: nothing to fetch, nothing made twice.
            kept = self.reduced.keep(reply)
            return Completed(reply, kept.receipt, TokenArrays(kept.layout, kept.tokens), kept.reply_json)
        reply_json = bytes(body) if framed and reply.parsed_from(payload) else None
        return Completed(reply, receipt, tokens, reply_json)

    def _run_json(self, body: bytes | bytearray) -> Any:
        """A `/run` body's JSON: msgspec's parse (in C, four times pydantic's speed on a real Gym
        reply's 30,000 numbers), which gives the standard library's values for any JSON it reads;
        where it refuses the body (no JSON, or a number past a double's range, which the standard
        library reads as infinity), pydantic's, for its exact value or refusal as before."""
        try:
            return msgspec.json.decode(body)
        except msgspec.DecodeError:
            return self._validated(_JSON.validate_json, "JSON", body, "/run")

    def _completion_parts(
        self, parts: CompletionParts, rollout_id: str, attempt_index: int
    ) -> tuple[CompletionReceipt | BadResponseError, TokenArrays | BadResponseError | None]:
        """The receipt and token records a completion frame carries, each checked exactly as
        `completion_receipt` and `token_capture` check fetched ones (a refusal is kept, to be raised
        where the fetch would have raised it).  Token records are read against the receipt's key."""
        where = f"/run ({rollout_id}, {attempt_index}) receipt"
        try:
            receipt = self._validated(
                CompletionReceipt.model_validate_json, "CompletionReceipt", parts.receipt, where
            )
        except BadResponseError as exc:
            return exc, None
        if receipt.attempt != (rollout_id, attempt_index):
            return BadResponseError(f"{self.base_url}{where}: receipt names {receipt.attempt}"), None
        try:
            tokens: TokenArrays | BadResponseError = self._binary_tokens(
                parts.tokens,
                f"/run ({rollout_id}, {attempt_index}) token records",
                receipt.manifest_capture_key,
            )
        except BadResponseError as exc:
            tokens = exc
        return receipt, tokens

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
        return self._parse(Health, await self._send(self._control, "GET", "/health"), "/health")

    async def capabilities(self) -> Capabilities:
        return self._parse(
            Capabilities, await self._send(self._control, "GET", "/capabilities"), "/capabilities"
        )

    async def status(self) -> AgentStatus:
        if self.reduced is not None:
            return self.reduced.status()
        return self._parse(AgentStatus, await self._send(self._control, "GET", "/status"), "/status")

    async def completion_receipt(self, rollout_id: str, attempt_index: int) -> CompletionReceipt:
        if self.reduced is not None:
            return self.reduced.completion_receipt(rollout_id, attempt_index)
        path = f"/completion_receipt/{rollout_id}/{attempt_index}"
        receipt = self._parse(CompletionReceipt, await self._send(self._control, "GET", path), path)
        if receipt.attempt != (rollout_id, attempt_index):
            raise BadResponseError(f"{self.base_url}{path}: receipt names {receipt.attempt}")
        return receipt

    async def token_capture(self, capture_key: str) -> TokenArrays:
        """The attempt's token records in their canonical binary form, as arrays.  An agent that speaks
        the binary form answers in it (no JSON, no per-token Python object on this side); one that
        does not answers JSON, converted once here."""
        if self.reduced is not None:
            return decode_arrays(self.reduced.token_bytes(capture_key), check_canonical=False)
        path = f"/token_capture/{capture_key}"
        reply = await self._exchange(self._control, "GET", path, extra_headers=_ACCEPT_TOKENS)
        if _media_type(reply) == _TOKENS_MEDIA:
            # A body read in place is a bytearray: the arrays over it stay read-only all the same.
            return self._binary_tokens(memoryview(reply.body).toreadonly(), path, capture_key)
        entries = self._validated(_TOKEN_LIST.validate_json, "list[TokenEntry]", reply.body, path)
        try:
            arrays = decode_arrays(encode_entries(entries))
        except TokenCodecError as exc:
            raise BadResponseError(f"{self.base_url}{path}: {exc}") from None
        if any(e.rollout_id != capture_key for e in entries):
            raise BadResponseError(f"{self.base_url}{path}: token records of another capture key")
        return arrays

    def _binary_tokens(self, body: bytes | memoryview, where: str, capture_key: str) -> TokenArrays:
        """Token records in their binary form, as arrays, held to the rules the JSON form is read by;
        every record of `capture_key`.  (From `/token_capture` or a completion frame.)"""
        try:
            arrays = binary_token_records(body)
        except TokenCodecError as exc:
            raise BadResponseError(f"{self.base_url}{where}: {exc}") from None
        except ValidationError as exc:
            raise BadResponseError(f"{self.base_url} {where}: reply fails list[TokenEntry]: {exc}") from None
        if any(r.get("rollout_id") != capture_key for r in arrays.records):
            raise BadResponseError(f"{self.base_url}{where}: token records of another capture key")
        return arrays

    async def acknowledge(self, receipts: Sequence[CompletionReceipt]) -> list[AcknowledgeResult]:
        """ONE `/acknowledge` request carrying every receipt; one result per receipt, in order."""
        if not receipts:
            return []
        if self.reduced is not None:
            return self.reduced.acknowledge(receipts)
        body = AcknowledgeRequest(
            executions=[AcknowledgeItem(agent_name=self.agent_name, receipt=r) for r in receipts]
        )
        answer = self._parse(
            AcknowledgeResponse,
            await self._send(self._control, "POST", "/acknowledge", body=body, extra_headers=self._trainer),
            "/acknowledge",
        )
        if [(r.rollout_id, r.attempt_index) for r in answer.results] != [r.attempt for r in receipts]:
            raise BadResponseError(f"{self.base_url}/acknowledge: results do not match the receipts sent")
        return answer.results

    async def retire(
        self, rollout_id: str, attempt_index: int, checkpoint_id: str | None = None
    ) -> RetireResponse:
        if self.reduced is not None:
            return self.reduced.retire(rollout_id, attempt_index)
        body = RetireRequest(rollout_id=rollout_id, attempt_index=attempt_index, checkpoint_id=checkpoint_id)
        return self._parse(
            RetireResponse,
            await self._send(self._control, "POST", "/retire", body=body, extra_headers=self._trainer),
            "/retire",
        )

    async def prepare(
        self, checkpoint_id: str, timeout_s: float = 300.0, carry: bool = False
    ) -> PhaseResponse:
        """Ready: the answer (phase `prepared`; with `carry`, to an agent that can, the finished
        unACKed attempts it carries in `carried`). Not ready: raises `NotReadyError` listing the attempts to
        ACK/adopt."""
        if self.reduced is not None:
            raise self.reduced.refuse_checkpoint("prepare", checkpoint_id)
        body = PrepareRequest(
            checkpoint_id=checkpoint_id, timeout_s=timeout_s, carry_completed=carry and self.carries_completed
        )
        http_timeout = max(self.control_timeout_s, timeout_s + PREPARE_MARGIN_S)
        payload = await self._send(
            self._phases,
            "POST",
            "/checkpoint/prepare",
            body=body,
            timeout_s=http_timeout,
            extra_headers=self._trainer,
        )
        return self._parse(PhaseResponse, payload, "/checkpoint/prepare")

    async def _phase_call(self, op: str, checkpoint_id: str) -> PhaseResponse:
        if self.reduced is not None:
            raise self.reduced.refuse_checkpoint(op, checkpoint_id)
        path = f"/checkpoint/{op}"
        payload = await self._send(
            self._phases,
            "POST",
            path,
            body=CheckpointRequest(checkpoint_id=checkpoint_id),
            extra_headers=self._trainer,
        )
        return self._parse(PhaseResponse, payload, path)

    async def commit(self, checkpoint_id: str) -> PhaseResponse:
        return await self._phase_call("commit", checkpoint_id)

    async def resume(self, checkpoint_id: str) -> PhaseResponse:
        return await self._phase_call("resume", checkpoint_id)

    async def abort(self, checkpoint_id: str) -> PhaseResponse:
        """Idempotent for an aborted or never-seen checkpoint (presumed abort)."""
        return await self._phase_call("abort", checkpoint_id)

    # -- the one trainer that drives the agent ------------------------------------------------------------

    def drive_as(self, trainer_id: str | None) -> None:
        """Names `trainer_id` on every later call that changes what the agent holds (`x-ledger-trainer`),
        so the agent refuses this client's calls if another trainer drives it (participant.driver)."""
        self._trainer = ((TRAINER_HEADER.encode(), (trainer_id or "").encode()),)

    async def bind_driver(self, trainer_id: str | None) -> DriverResponse | None:
        """`POST /driver`: binds the agent to `trainer_id`, or raises `TrainerConflictError` naming the
        trainer that drives it.  None for an agent without the route (a plain Gym agent, an older
        participant): it cannot tell trainers apart."""
        if self.reduced is not None:
            return None
        try:
            payload = await self._send(
                self._control, "POST", "/driver", body=DriverRequest(trainer_id=trainer_id)
            )
        except NotFoundError:
            return None
        return self._parse(DriverResponse, payload, "/driver")

    async def release_driver(self, trainer_id: str | None) -> DriverResponse | None:
        """`POST /driver/release`: unbinds the agent if it holds nothing of `trainer_id` (else it stays
        bound, for that trainer's recovery)."""
        if self.reduced is not None:
            return None
        try:
            payload = await self._send(
                self._control, "POST", "/driver/release", body=DriverRequest(trainer_id=trainer_id)
            )
        except NotFoundError:
            return None
        return self._parse(DriverResponse, payload, "/driver/release")

    # -- reference-agent debugging -----------------------------------------------------------------------

    async def set_faults(self, fault: AttemptFault | RateFaults | CrashAfter) -> None:
        self._parse(
            OkResponse, await self._send(self._control, "POST", "/debug/faults", body=fault), "/debug/faults"
        )

    async def debug_runs(self) -> dict[str, int]:
        return self._parse(
            DebugRuns, await self._send(self._control, "GET", "/debug/runs"), "/debug/runs"
        ).runs
