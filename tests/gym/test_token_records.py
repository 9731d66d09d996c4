"""Token records both ways: the real Gym's `TokenEntry` rules, its lineage hashes, the lineage this
project writes (`protocol.lineage`), and full prompts rebuilt from delta chains.

The golden values were computed by nemo-gym 0.7.0's own functions (`compute_digest`,
`assistant_fingerprint`, `conversation_digest`); tests/realgym recomputes them live in the real Gym's
environment on every run (`test_lineage_hashes_match_the_real_gym`).
"""

from __future__ import annotations

import contextlib
import struct
from typing import Any
from unittest import mock

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from protocol import lineage
from protocol.lineage import (
    NO_MATCH,
    NOT_A_PREFIX,
    LineageError,
    assistant_fingerprint,
    conversation_digest,
    full_prompts,
    link_call,
    token_digest,
    u4_token_digest,
)
from protocol.tokens import token_records_from_reply
from protocol.wire import TokenEntry, gym_reply

TOKEN_GOLDEN: list[list[Any]] = [
    [[], "2e222d36d0c6ae1db1ec18b3f96d9a46df5db61b40137bbfbac4cdf0acde9763"],
    [[0], "0596efeb21b51ec6eb122c9e470703df19a095a7c5ccb96bf87df0ba2447ba59"],
    [
        [1, 2, 3, 9223372036854775808, 18446744073709551615],
        "f979ff8b2624fc214c70a5c5b372e4133acaf65dd9c5634380beb0d350b6a3e1",
    ],
]

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [],
    [{"role": "user", "content": "weather in sf?"}],
    [
        {"role": "user", "content": "weather in sf?"},
        {
            "type": "function_call",
            "id": "fc-1",
            "call_id": "call-1",
            "name": "get_weather",
            "arguments": '{"city": "sf"}',
            "status": "completed",
        },
        {"type": "function_call_output", "call_id": "call-1", "output": '{"city": "sf", "weather": "cold"}'},
        {
            "type": "message",
            "id": "msg-2",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "It is cold.", "annotations": []}],
        },
    ],
    [
        {
            "role": "system",
            "content": [
                {"type": "input_text", "text": "be brief"},
                {"type": "input_image", "image_url": "x", "detail": 0.5},
            ],
        },
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "t1", "function": {"name": "f", "arguments": "not json "}}],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
        {"type": "function_call_output", "call_id": "c0", "output": {"k": [1, 2.5e-07, "\u00e9"]}},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "u1", "name": "g", "input": {"b": 1, "a": None}}, "plain"],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "u1", "content": [{"type": "text", "text": "ok"}]}
            ],
        },
        {"type": "function_call", "namespace": "ns", "name": "h", "call_id": "c9", "arguments": {"z": 1e300}},
    ],
]

# (assistant_fingerprint, conversation_digest) of each conversation above.
CONVERSATION_GOLDEN: list[list[str]] = [
    ["", "edd3713968ca572ae44468ff61fabbec572e8de247023892e8bdf0f55aa8cb9f"],
    ["", "cf66668c1c1490ad89a1205b4e591d75d372e868316cf9263fd2fe6dca682b8a"],
    [
        "dc4dfc3d83227e2d0a39d81a2736b6ace230b7e0256aa1e5efce0f60736ba6cf",
        "9b63b7187fca219a1844852e46b5131e864193815e8190eec70df726656a6e08",
    ],
    [
        "2d80603f2b19995fdb800c4e6a55b50b341d3993b65ccbb196907b44eab44de7",
        "02665bbfdaf01cb049713536b9a667f4a75496bf23ce99f1f2967a605480a49b",
    ],
]


@pytest.mark.parametrize("numpy", [True, False])
@given(st.lists(st.integers(0, 2**32 - 1), max_size=300))
def test_ids_packed_as_u4_hash_as_the_ids_do(numpy: bool, ids: list[int]) -> None:
    """The binary form's u4 arrays widened to the digest's 64 bits (by numpy, or by byte slices in a
    core install without it) hash as the ids themselves."""
    packed = struct.pack(f"<{len(ids)}I", *ids)
    with contextlib.nullcontext() if numpy else mock.patch.object(lineage, "_np", None):
        assert u4_token_digest(len(ids), packed) == token_digest(ids)


def test_lineage_hashes_are_the_real_gyms() -> None:
    for ids, digest in TOKEN_GOLDEN:
        assert token_digest(ids) == digest
    for items, (fingerprint, context) in zip(CONVERSATIONS, CONVERSATION_GOLDEN, strict=True):
        assert assistant_fingerprint(items) == fingerprint
        assert conversation_digest(items) == context
    with pytest.raises(ValueError):
        token_digest([-1])
    with pytest.raises(ValueError):
        conversation_digest([{"role": "tool", "content": {"not": "a list"}}])


def _record(call: str, prompt: list[int], gen: list[int], **fields: Any) -> dict[str, Any]:
    return {
        "rollout_id": "k",
        "model_call_id": call,
        "prompt_token_ids": prompt,
        "generation_token_ids": gen,
        "generation_log_probs": [-0.5] * len(gen),
        **fields,
    }


# A record as nemo-gym 0.7.0's capture writes it: every lineage field, and one a newer writer added.
REAL_RECORD = _record(
    "c2",
    [5],
    [6, 7],
    schema_version=1,
    model="m",
    output_items=[{"type": "message", "role": "assistant", "content": "x"}],
    token_item_index=0,
    response_id="resp-2",
    created_at=1.5,
    parent_call_id="c1",
    cum_len=6,
    digest=token_digest([1, 2, 3, 5, 6, 7]),
    parent_resolution="resolved",
    continuation_fingerprint="f" * 64,
    continuation_context_len=3,
    continuation_context_digest="d" * 64,
    parent_resolution_reason="",
    fingerprint_version=2,
    prompt_is_delta=True,
    prefix_requested=True,
    prefix_supplied=True,
    routed_experts=[[[1, 2]], [[3, 4]]],
    future_field={"kept": [1, 2]},
)


def test_a_real_gym_record_is_read_whole_and_given_back_as_it_came() -> None:
    entry = TokenEntry.model_validate(REAL_RECORD)
    assert entry.record() == REAL_RECORD
    # Only what was set comes back: a minimal record gains no defaults on the way through.
    minimal = _record("c1", [1, 2, 3], [4])
    assert TokenEntry.model_validate(minimal).record() == minimal


# What the real reader refuses, and why (tests/realgym hands the same records to the real reader).
REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"schema_version": 2}, "schema_version 2"),
    ({"schema_version": 0}, "schema_version 0"),
    ({"generation_log_probs": [-1.0]}, "differ in length"),
    ({"token_item_index": 1}, "outside output_items"),
    ({"token_item_index": -1}, "outside output_items"),
    ({"parent_call_id": None, "parent_resolution": None}, "delta prompt"),
    ({"parent_call_id": ""}, "resolved parent needs"),
    ({"parent_resolution": "root"}, "names no parent_call_id"),
    ({"parent_resolution": "maybe"}, "parent_resolution"),
    ({"prompt_token_ids": ["x"]}, "prompt_token_ids"),
]


@pytest.mark.parametrize(("change", "why"), REFUSED)
def test_what_the_real_reader_refuses_is_refused(change: dict[str, Any], why: str) -> None:
    with pytest.raises(ValidationError, match=why):
        TokenEntry.model_validate(REAL_RECORD | change)


def test_a_new_field_of_a_newer_writer_is_kept_under_the_version_it_understands() -> None:
    assert TokenEntry.model_validate(REAL_RECORD).model_extra == {"future_field": {"kept": [1, 2]}}


def _reply(output: list[dict[str, Any]]) -> Any:
    return gym_reply(
        {
            "responses_create_params": {"input": "weather in sf?"},
            "response": {"id": "resp-last", "model": "m", "output": output},
            "reward": 1.0,
        },
        "k",
        0,
    )


def _carrier(kind: str, prompt: list[int], gen: list[int], **item: Any) -> dict[str, Any]:
    return {
        "type": kind,
        **item,
        "prompt_token_ids": prompt,
        "generation_token_ids": gen,
        "generation_log_probs": [-0.1] * len(gen),
    }


TOOL_CALL = {"id": "fc-1", "call_id": "call-1", "name": "get_weather", "arguments": '{"city": "sf"}'}
TOOL_OUTPUT = {"type": "function_call_output", "call_id": "call-1", "output": "cold"}
ANSWER = {"id": "msg-2", "role": "assistant", "content": [{"type": "output_text", "text": "cold"}]}


def test_records_read_off_a_reply_carry_the_lineage_the_real_consumer_resolves() -> None:
    reply = _reply(
        [
            _carrier("function_call", [1, 2, 3], [4, 5], **TOOL_CALL),
            TOOL_OUTPUT,
            _carrier("message", [1, 2, 3, 4, 5, 9, 9], [6], **ANSWER),
        ]
    )
    first, second = token_records_from_reply(reply, "k", 7.0)
    assert (first.parent_resolution, first.parent_call_id, first.response_id) == ("root", None, None)
    assert (second.parent_resolution, second.parent_call_id) == ("resolved", first.model_call_id)
    assert second.response_id == "resp-last"  # the reply's response is the last call's
    assert (first.cum_len, first.digest) == (5, token_digest([1, 2, 3, 4, 5]))
    assert (second.cum_len, second.digest) == (8, token_digest([1, 2, 3, 4, 5, 9, 9, 6]))
    user = {"role": "user", "content": "weather in sf?"}
    stripped_call = {"type": "function_call", **TOOL_CALL}
    assert first.continuation_context_len == 1
    assert first.continuation_context_digest == conversation_digest([user])
    assert second.continuation_context_len == 3
    assert second.continuation_context_digest == conversation_digest(
        [user, _carrier("function_call", [1, 2, 3], [4, 5], **TOOL_CALL), TOOL_OUTPUT]
    )
    # The next request's fingerprint finds the call it continues: its own request + output.
    assert first.continuation_fingerprint == assistant_fingerprint([user, stripped_call])
    assert {first.fingerprint_version, second.fingerprint_version} == {2}
    # Every field the consumer reads is written, none left to a default.
    assert {"parent_resolution", "parent_resolution_reason", "prompt_is_delta", "response_id"} <= set(
        first.record()
    )
    assert full_prompts([first, second]) == [[1, 2, 3], [1, 2, 3, 4, 5, 9, 9]]


def test_a_prompt_that_does_not_extend_its_parent_is_not_resolved() -> None:
    reply = _reply(
        [
            _carrier("function_call", [1, 2, 3], [4, 5], **TOOL_CALL),
            TOOL_OUTPUT,
            _carrier("message", [1, 2, 3, 9], [6], **ANSWER),  # the context was re-rendered: no prefix
        ]
    )
    _, second = token_records_from_reply(reply, "k", 7.0)
    assert (second.parent_resolution, second.parent_call_id) == ("unresolved", None)
    assert second.parent_resolution_reason == NOT_A_PREFIX


def test_without_requests_the_tokens_alone_link_the_calls() -> None:
    one = link_call(TokenEntry.model_validate(_record("c1", [1, 2], [3])), None, [])
    two = link_call(TokenEntry.model_validate(_record("c2", [1, 2, 3, 4], [5])), None, [one])
    three = link_call(TokenEntry.model_validate(_record("c3", [8], [9])), None, [one, two])
    assert [r.parent_resolution for r in (one, two, three)] == ["root", "resolved", "unresolved"]
    assert (two.parent_call_id, three.parent_resolution_reason) == ("c1", NO_MATCH)


def _delta_chain() -> list[TokenEntry]:
    """c1 whole, c2 and c3 stored as deltas after their parents (as 0.7.0 writes with delta records)."""
    return [
        TokenEntry.model_validate(r)
        for r in (
            _record(
                "c1",
                [1, 2, 3],
                [4, 5],
                parent_resolution="root",
                cum_len=5,
                digest=token_digest([1, 2, 3, 4, 5]),
            ),
            _record(
                "c2",
                [6, 7],
                [8],
                parent_resolution="resolved",
                parent_call_id="c1",
                prompt_is_delta=True,
                cum_len=8,
                digest=token_digest([1, 2, 3, 4, 5, 6, 7, 8]),
            ),
            _record(
                "c3",
                [9],
                [10],
                parent_resolution="resolved",
                parent_call_id="c2",
                prompt_is_delta=True,
                cum_len=10,
                digest=token_digest(list(range(1, 11))),
            ),
        )
    ]


def test_full_prompts_rebuild_a_delta_chain_in_any_order() -> None:
    c1, c2, c3 = _delta_chain()
    assert full_prompts([c3, c1, c2]) == [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3], [1, 2, 3, 4, 5, 6, 7]]


def test_a_broken_delta_chain_is_refused_by_name() -> None:
    c1, c2, c3 = _delta_chain()
    with pytest.raises(LineageError, match=r"'c3'.*parent 'c2' is not among"):
        full_prompts([c1, c3])
    forged = c2.model_copy(update={"prompt_token_ids": [6, 0]})
    with pytest.raises(LineageError, match=r"'c2'.*does not match its digest"):
        full_prompts([c1, forged, c3])
