"""An attempt's completion as the trainer receives it: the `/run` reply and, where the agent carried
them, its receipt and token records, each checked as its own fetch would check it.

Here too are the checks both ways of receiving them share (fetched by `GymClient.token_capture`, or
carried in a `/run` completion frame): binary token records held to `TokenEntry`'s rules, and a
receipt held to the reply it names (`verify_receipt`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError

from payloads.token_arrays import TokenArrays, canonical_arrays
from protocol.completion import CompletionParts
from protocol.ids import capture_key
from protocol.token_codec import ARRAY_FIELDS, TokenCodecError
from protocol.wire import CompletionReceipt, RunReply, TokenEntry
from trainer.gym.answers import validated
from trainer.gym.errors import BadResponseError, ReceiptMismatchError

TOKEN_LIST = TypeAdapter(list[TokenEntry])
_NO_ARRAYS: dict[str, list[Any]] = {name: [] for name in ARRAY_FIELDS}


def binary_token_records(body: bytes | memoryview) -> TokenArrays:
    """A `/token_capture` body in the binary form as arrays over its canonical form (the body itself
    when it is canonical: checked, not re-encoded), each record's other fields held to TokenEntry's
    rules as the JSON form is (its arrays, checked by the codec, stand in empty: no per-token Python
    object).  TokenCodecError or pydantic's ValidationError."""
    arrays = canonical_arrays(body, routes_as_text=True)  # router choices never made into lists
    if not arrays.resolved:
        raise TokenCodecError("token records on the wire hold their own output items (form version 1)")
    TOKEN_LIST.validate_python([{**r, **_NO_ARRAYS} for r in arrays.records])
    return arrays


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
    # Where `tokens` are already the form stored beside the reply (the trainer's reduced mode read
    # them off this very reply): their media type.  None for records as an agent sends them.
    tokens_beside: str | None = None

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


def binary_tokens(base_url: str, body: bytes | memoryview, where: str, capture_key: str) -> TokenArrays:
    """Token records in their binary form, as arrays, held to the rules the JSON form is read by;
    every record of `capture_key`.  (From `/token_capture` or a completion frame.)"""
    try:
        arrays = binary_token_records(body)
    except TokenCodecError as exc:
        raise BadResponseError(f"{base_url}{where}: {exc}") from None
    except ValidationError as exc:
        raise BadResponseError(f"{base_url} {where}: reply fails list[TokenEntry]: {exc}") from None
    if any(r.get("rollout_id") != capture_key for r in arrays.records):
        raise BadResponseError(f"{base_url}{where}: token records of another capture key")
    return arrays


def completion_parts(
    base_url: str, parts: CompletionParts, rollout_id: str, attempt_index: int
) -> tuple[CompletionReceipt | BadResponseError, TokenArrays | BadResponseError | None]:
    """The receipt and token records a completion frame carries, each checked exactly as
    `completion_receipt` and `token_capture` check fetched ones (a refusal is kept, to be raised
    where the fetch would have raised it).  Token records are read against the receipt's key."""
    where = f"/run ({rollout_id}, {attempt_index}) receipt"
    try:
        receipt = validated(
            base_url, CompletionReceipt.model_validate_json, "CompletionReceipt", parts.receipt, where
        )
    except BadResponseError as exc:
        return exc, None
    if receipt.attempt != (rollout_id, attempt_index):
        return BadResponseError(f"{base_url}{where}: receipt names {receipt.attempt}"), None
    try:
        tokens: TokenArrays | BadResponseError = binary_tokens(
            base_url,
            parts.tokens,
            f"/run ({rollout_id}, {attempt_index}) token records",
            receipt.manifest_capture_key,
        )
    except BadResponseError as exc:
        tokens = exc
    return receipt, tokens
