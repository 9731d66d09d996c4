"""The lineage of a try's model calls, as the real Gym's consumer resolves it.

A consumer (NeMo Gym's `trajectories_for_rollout`, and whatever rebuilds full prompts here) chains a
try's token records into one token sequence: each call names its parent, the parent's full sequence
(prompt + generation) is identified by its length and digest, and a child's prompt must start with it.
A record whose parent is not proven starts a fragment, and a fragmented try is masked, never trained.
This module holds those rules in one place, for both directions:

- writing: `link_call` stamps the lineage on one record given the try's calls before it (the
  participant library, the reference agent and reduced mode all write through it);
- reading: `full_prompts` rebuilds every call's full prompt, walking the parent chain of records whose
  prompt is stored as a delta (only the suffix after the parent's sequence), each rebuilt sequence
  checked against the record's own digest.

The hashes are a wire contract shared with the Gym (the same bytes on both sides):

- a token digest is SHA-256 over the domain `nemo-gym-tokens`, then (for a non-empty sequence) the
  encoding version byte (1), the count as 8 bytes and each id as 8 bytes, all big-endian;
- a fingerprint hashes a list of conversation items as tagged fields, each a tag byte, the UTF-8
  length as 8 big-endian bytes and the UTF-8 text.  `assistant_fingerprint` (domain
  `nemo-gym-lineage`) covers only the model-authored items (role `assistant`, or a `function_call`
  item): their typed content parts and their tool calls (id, name, canonical arguments);
  `conversation_digest` (domain `nemo-gym-lineage-context`) covers every item: its role or type, its
  content parts, tool calls and tool results.  Canonical JSON for these is orjson's, keys sorted.
"""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from collections.abc import Iterator, Sequence
from typing import Any, Final

import orjson

from protocol._numpy import np as _np
from protocol.wire import TokenEntry

DIGEST_VERSION: Final = 1
FINGERPRINT_VERSION: Final = 2
_TOKENS_DOMAIN: Final = b"nemo-gym-tokens"
_FINGERPRINT_DOMAIN: Final = b"nemo-gym-lineage"
_CONTEXT_DOMAIN: Final = b"nemo-gym-lineage-context"
# Content-block types whose `text` is the part itself; any other typed block is hashed whole.
_TEXT_BLOCKS: Final = frozenset({"", "text", "input_text", "output_text"})
# Blocks hashed as tool calls or tool results, never as content.
_TOOL_BLOCKS: Final = frozenset({"tool_use", "tool_result"})
# Resolution reasons this project writes (the Gym's own resolver writes its own, e.g. "no_match").
NO_MATCH: Final = "no_match"
AMBIGUOUS: Final = "ambiguous"
NOT_A_PREFIX: Final = "prompt_does_not_extend_parent"


class LineageError(ValueError):
    """A try's records cannot be chained into full prompts (a broken or forged delta chain)."""


# --- the token digest ------------------------------------------------------------------------


def token_digest(token_ids: Sequence[int]) -> str:
    """The hex digest of an exact token sequence (ValueError for an id outside 0..2**64-1)."""
    if not token_ids:
        return packed_token_digest(0, b"")
    try:
        packed = array("Q", token_ids)
    except OverflowError:
        raise ValueError("token ids must be in 0..2**64-1") from None
    if sys.byteorder == "little":
        packed.byteswap()
    return packed_token_digest(len(token_ids), packed.tobytes())


def u4_token_digest(count: int, little_endian_u32: bytes) -> str:
    """`token_digest` of `count` ids given as little-endian unsigned 32-bit integers (the binary
    form's u4 arrays): each widened to big-endian 64 bits in one numpy cast where numpy is here (an
    agent's install), else by byte slices; never a Python int per id."""
    if _np is not None and len(little_endian_u32) == 4 * count:
        wide = _np.frombuffer(little_endian_u32, dtype="<u4").astype(">u8").tobytes()
        return packed_token_digest(count, wide)
    widened = bytearray(8 * count)
    for byte in range(4):
        widened[7 - byte :: 8] = little_endian_u32[byte::4]
    return packed_token_digest(count, widened)


def packed_token_digest(count: int, big_endian_u64: bytes | bytearray) -> str:
    """`token_digest` of `count` ids given as big-endian unsigned 64-bit integers (the arrays' way)."""
    hasher = hashlib.sha256(_TOKENS_DOMAIN)
    if count:
        hasher.update(bytes([DIGEST_VERSION]) + count.to_bytes(8, "big"))
        hasher.update(big_endian_u64)
    return hasher.hexdigest()


# --- fingerprints ----------------------------------------------------------------------------


def _canonical(value: Any) -> str:
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
    except (TypeError, orjson.JSONEncodeError) as exc:
        raise ValueError(f"content that is not JSON: {type(value).__name__}") from exc


def canonical_arguments(value: Any) -> str:
    """A tool call's arguments for comparison: JSON text re-encoded canonically, other text stripped."""
    if value is None:
        return ""
    if not isinstance(value, str):
        return _canonical(value)
    try:
        parsed = json.loads(value)
    except ValueError:
        return value.strip()
    return _canonical(parsed)


def _model_authored(item: dict[str, Any]) -> bool:
    # Reasoning items are left out on purpose: an agent need not echo them back.
    return item.get("role") == "assistant" or item.get("type") == "function_call"


def _content_parts(content: Any) -> Iterator[tuple[str, str]]:
    if content is None:
        return
    if isinstance(content, str):
        if content:
            yield "text", content
        return
    if not isinstance(content, list):
        raise ValueError(f"content of type {type(content).__name__}")
    for block in content:
        if isinstance(block, str):
            if block:
                yield "text", block
            continue
        if not isinstance(block, dict):
            raise ValueError(f"content block of type {type(block).__name__}")
        kind = str(block.get("type") or "")
        if kind in _TOOL_BLOCKS:
            continue
        text = block.get("text")
        if kind in _TEXT_BLOCKS and isinstance(text, str):
            if text:
                yield "text", text
            continue
        if not kind:
            raise ValueError("content block without a type")
        yield kind, _canonical(block)


def _tool_calls(item: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(call id, name, canonical arguments) of every tool call an item makes, in any dialect."""
    if item.get("type") == "function_call":
        name = str(item.get("name", ""))
        if item.get("namespace"):
            name = f"{item['namespace']}__{name}"
        yield (
            str(item.get("call_id") or item.get("id") or ""),
            name,
            canonical_arguments(item.get("arguments")),
        )
    content = item.get("content")
    if isinstance(content, list):
        for block in content:
            if isinstance(block, dict) and block.get("type") == "tool_use":
                yield (
                    str(block.get("id") or ""),
                    str(block.get("name", "")),
                    canonical_arguments(block.get("input")),
                )
    for call in item.get("tool_calls") or []:
        function = (call or {}).get("function") or {}
        yield (
            str((call or {}).get("id") or ""),
            str(function.get("name", "")),
            canonical_arguments(function.get("arguments")),
        )


def _tool_results(item: dict[str, Any]) -> Iterator[tuple[str, str]]:
    def text_of(value: Any) -> str:
        return value if isinstance(value, str) else _canonical(value)

    if item.get("type") == "function_call_output":
        yield str(item.get("call_id") or item.get("id") or ""), text_of(item.get("output"))
    elif item.get("role") == "tool":
        yield str(item.get("tool_call_id") or ""), text_of(item.get("content"))
    content = item.get("content")
    if isinstance(content, list):
        for block in content:
            if isinstance(block, dict) and block.get("type") == "tool_result":
                yield str(block.get("tool_use_id") or block.get("id") or ""), text_of(block.get("content"))


class _Hasher:
    def __init__(self, domain: bytes) -> None:
        self._sha = hashlib.sha256(domain)

    def field(self, tag: int, text: str) -> None:
        encoded = text.encode()
        self._sha.update(bytes([tag]) + len(encoded).to_bytes(8, "big") + encoded)

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


def _items(items: Sequence[Any]) -> Iterator[dict[str, Any]]:
    for item in items:
        if not isinstance(item, dict):
            raise ValueError(f"a conversation item of type {type(item).__name__}")
        yield item


def assistant_fingerprint(items: Sequence[Any]) -> str:
    """The fingerprint of the model-authored items, in order; "" when there are none."""
    hasher = _Hasher(_FINGERPRINT_DOMAIN)
    authored = 0
    for item in _items(items):
        if not _model_authored(item):
            continue
        authored += 1
        for kind, text in _content_parts(item.get("content")):
            hasher.field(0, kind)
            hasher.field(1, text)
        for call_id, name, arguments in _tool_calls(item):
            hasher.field(2, call_id)
            hasher.field(3, name)
            hasher.field(4, arguments)
    return hasher.hexdigest() if authored else ""


def conversation_digest(items: Sequence[Any]) -> str:
    """The digest of every item of a conversation, tool results included."""
    hasher = _Hasher(_CONTEXT_DOMAIN)
    for item in _items(items):
        hasher.field(0, str(item.get("role") or item.get("type") or ""))
        for kind, text in _content_parts(item.get("content")):
            hasher.field(1, kind)
            hasher.field(2, text)
        for call_id, name, arguments in _tool_calls(item):
            hasher.field(3, call_id)
            hasher.field(4, name)
            hasher.field(5, arguments)
        for call_id, output in _tool_results(item):
            hasher.field(6, call_id)
            hasher.field(7, output)
    return hasher.hexdigest()


# --- writing: one try's calls, linked ---------------------------------------------------------


def _fingerprint_or_empty(items: Sequence[Any]) -> str:
    try:
        return assistant_fingerprint(items)
    except ValueError:
        return ""  # unhashable content: the record is then found by tokens only


def link_call(
    record: TokenEntry, request: Sequence[dict[str, Any]] | None, earlier: Sequence[TokenEntry]
) -> TokenEntry:
    """`record` with its lineage stamped, its prompt kept whole; `earlier` are the try's calls before
    it, already linked (by this function).

    `request` is the conversation the call was sent (its input items), or None when unknown.  A call
    whose request holds no model-authored item is a root.  Otherwise its parent is the one earlier
    call the request continues: the call whose own request + output has the request's fingerprint and
    whose request context the new request starts with (the latest call whose sequence the prompt
    extends, when the request is unknown); the parent is resolved only when the call's prompt tokens
    start with the parent's full sequence.  `response_id` and every field not named here are kept."""
    prompt, generation = record.prompt_token_ids, record.generation_token_ids
    cum_len = len(prompt) + len(generation)
    # The sequence's digest from the arrays `token_codec.with_arrays` packed beside the lists (both
    # u4), or from the lists.
    packed_prompt, packed_generation, _ = record.packed_arrays()
    if (
        packed_prompt is not None
        and packed_generation is not None
        and packed_prompt[0] == "u4" == packed_generation[0]
    ):
        digest = u4_token_digest(cum_len, packed_prompt[1] + packed_generation[1])
    else:
        digest = token_digest([*prompt, *generation])
    stamp: dict[str, Any] = {
        "schema_version": record.schema_version,
        "cum_len": cum_len,
        "digest": digest,
        "prompt_is_delta": False,
        # Set explicitly, so the record as written carries every field the consumer reads.
        "response_id": record.response_id,
        "prefix_requested": record.prefix_requested,
        "prefix_supplied": record.prefix_supplied,
    }
    if request is not None:
        stamp |= {
            "continuation_fingerprint": _fingerprint_or_empty([*request, *record.output_items]),
            "continuation_context_len": len(request),
            "continuation_context_digest": conversation_digest(request),
            "fingerprint_version": FINGERPRINT_VERSION,
        }
    stamp |= _resolve(prompt, request, earlier)
    return record.model_copy(update=stamp)


def link_calls(
    records: Sequence[TokenEntry], requests: Sequence[Sequence[dict[str, Any]] | None]
) -> list[TokenEntry]:
    """The records of one try, in call order, each linked by `link_call`; `requests[i]` is call i's."""
    if len(records) != len(requests):
        raise ValueError(f"{len(records)} records but {len(requests)} requests")
    linked: list[TokenEntry] = []
    for record, request in zip(records, requests, strict=True):
        linked.append(link_call(record, request, linked))
    return linked


def _whole_sequence(entry: TokenEntry) -> list[int]:
    if entry.prompt_is_delta:
        raise LineageError(f"model call {entry.model_call_id!r} holds a delta prompt: link whole prompts")
    return list(entry.prompt_token_ids) + list(entry.generation_token_ids)


def _resolve(
    prompt: list[int], request: Sequence[dict[str, Any]] | None, earlier: Sequence[TokenEntry]
) -> dict[str, Any]:
    def verdict(status: str, parent: str | None = None, reason: str = "") -> dict[str, Any]:
        return {"parent_resolution": status, "parent_call_id": parent, "parent_resolution_reason": reason}

    if request is None:
        if not earlier:
            return verdict("root")
        extended = [e for e in earlier if prompt[: len(seq := _whole_sequence(e))] == seq]
        if not extended:
            return verdict("unresolved", reason=NO_MATCH)
        return verdict("resolved", extended[-1].model_call_id)
    wanted = _fingerprint_or_empty(request)
    if not wanted:
        return verdict("root")
    candidates = [
        e
        for e in earlier
        if e.continuation_fingerprint == wanted
        and len(request) >= e.continuation_context_len
        and conversation_digest(request[: e.continuation_context_len]) == e.continuation_context_digest
    ]
    if not candidates:
        return verdict("unresolved", reason=NO_MATCH)
    # Calls with identical sequences are interchangeable (an identical retry): the first stands.
    if len({(e.digest, e.cum_len) for e in candidates}) > 1:
        return verdict("unresolved", reason=AMBIGUOUS)
    parent = candidates[0]
    sequence = _whole_sequence(parent)
    if prompt[: len(sequence)] != sequence:
        return verdict("unresolved", reason=NOT_A_PREFIX)
    return verdict("resolved", parent.model_call_id)


# --- reading: full prompts -----------------------------------------------------------------


def full_prompts(records: Sequence[TokenEntry]) -> list[list[int]]:
    """Every record's full prompt, in the records' order: a delta prompt rebuilt from its parent chain
    (the parent's full sequence, then the suffix), the rebuilt sequence checked against the record's
    digest.  `LineageError` names the first record whose chain is broken (a parent missing, a cycle,
    a digest that does not verify)."""
    by_id = {r.model_call_id: r for r in records}
    sequences: dict[str, list[int]] = {}

    def sequence_of(call_id: str) -> list[int]:
        # Walk up to the nearest record with a whole prompt (or one already rebuilt), then down.
        path: list[TokenEntry] = []
        current = call_id
        while current not in sequences:
            record = by_id.get(current)
            if record is None:
                raise LineageError(f"model call {call_id!r}: its parent {current!r} is not among the records")
            if any(r.model_call_id == current for r in path):
                raise LineageError(f"model call {call_id!r}: its parent chain is a cycle")
            path.append(record)
            if not record.prompt_is_delta:
                break
            assert record.parent_call_id is not None  # TokenEntry refuses a delta without one
            current = record.parent_call_id
        base: list[int] = []
        for record in reversed(path):
            if record.prompt_is_delta:
                parent = record.parent_call_id
                assert parent is not None
                base = sequences[parent] + list(record.prompt_token_ids)
            else:
                base = list(record.prompt_token_ids)
            full = base + list(record.generation_token_ids)
            if record.digest is not None and token_digest(full) != record.digest:
                raise LineageError(
                    f"model call {record.model_call_id!r}: its rebuilt sequence does not match its digest"
                )
            sequences[record.model_call_id] = full
        return sequences[call_id]

    prompts = []
    for record in records:
        if not record.prompt_is_delta:
            prompts.append(list(record.prompt_token_ids))
            continue
        full = sequence_of(record.model_call_id)
        prompts.append(full[: len(full) - len(record.generation_token_ids)])
    return prompts
