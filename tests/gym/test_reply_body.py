"""A `/run` body's router choices held as their text (`trainer.gym.reply_body.decode_body`,
`protocol.routes.RoutesText`): for any body the values are the standard library's; the text is held
exactly where it is a regular integer array's own text on an output item; and every pass over the
reply (its nesting check, canonical JSON, pydantic's dump, the records' typed array) takes it for
the lists it stands for."""

from __future__ import annotations

import json
import random
from typing import Any

import msgspec
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.gym_reply import walked_check_depth
from payloads.token_arrays import canonical_arrays
from protocol import routes as held_routes
from protocol.digests import canonical_bytes, json_canonical_bytes, same_json
from protocol.routes import TYPED_FROM_TOKENS, RoutesText, routes_text
from protocol.token_codec import encode_entries, referred, reply_output_of, routes_array
from protocol.tokens import token_records_from_reply
from protocol.wire import MAX_JSON_DEPTH, check_depth, gym_reply
from tests.gym.test_reduced_keep import _routes
from trainer.gym.reply_body import decode_body
from trainer.gym.runs import run_json

ROUTES = [[[t % 64, (t * 7) % 64]] for t in range(TYPED_FROM_TOKENS + 10)]


def _body(output: list[Any], **extra: Any) -> bytes:
    reply = {"responses_create_params": {"input": "hi"}, "reward": 1.0, "id": "r", **extra}
    # Compact, as orjson writes it (json's writer: an integer past 64 bits too).
    return json.dumps({**reply, "response": {"id": "resp", "output": output}}, separators=(",", ":")).encode()


def _held(value: Any) -> list[Any]:
    """The output items' `routed_experts` that the parse held as text."""
    return [
        item["routed_experts"]
        for item in value["response"]["output"]
        if isinstance(item, dict) and type(item.get("routed_experts")) is RoutesText
    ]


def _same_as_json(body: bytes) -> Any:
    """`decode_body(body)`, checked against the standard library's parse: equal values, the same
    canonical JSON (json's own encoding of both, and ours of the parse)."""
    got, want = decode_body(body), json.loads(body)
    assert got == want and want == got
    assert json_canonical_bytes(got) == json_canonical_bytes(want) == canonical_bytes(got)
    return got


def test_a_real_gym_replys_router_choices_are_held_as_text_and_read_as_their_lists() -> None:
    body = _body(
        [
            {"type": "function_call", "routed_experts": ROUTES, "generation_log_probs": [-0.5]},
            {"type": "function_call_output", "output": "3"},
            {"type": "message", "routed_experts": [[[-(2**31), 2**31 - 1]]] * 70},
        ]
    )
    got = _same_as_json(body)
    first, second = _held(got)
    assert (first.shape, first.dtype, second.shape, second.dtype) == ((74, 1, 2), "i2", (70, 1, 2), "i4")
    assert first.lists() == ROUTES and first.text == orjson.dumps(ROUTES)
    # The typed array the records store is the one the lists give.
    assert routes_array(first) == routes_array(ROUTES) == (first.dtype, first.shape, first.data)
    # pydantic dumps the reply as the agent sent it; the reply's digest is the lists' digest.
    reply = gym_reply(got, "r-1", 0)
    assert reply.payload() == gym_reply(json.loads(body), "r-1", 0).payload()
    assert reply.digest() == gym_reply(json.loads(body), "r-1", 0).digest()
    assert reply.model_dump_json() == gym_reply(json.loads(body), "r-1", 0).model_dump_json()


@pytest.mark.parametrize(
    "routes",
    [
        ROUTES[: TYPED_FROM_TOKENS - 1],  # too few tokens
        [*ROUTES, [[1]]],  # ragged
        [*ROUTES, [[1, 2], [3, 4]]],  # ragged layers
        [*ROUTES, [[1.0, 2]]],
        [*ROUTES, [[True, 2]]],
        [*ROUTES, [[1, 2**31]]],  # past int32
        [*ROUTES, [[1, 2**63]]],  # past int64: numpy's limit, refused by the text
        [*ROUTES, [[1, -(2**70)]]],
        [*ROUTES, [[None, 1]]],
        [*ROUTES, []],
        [r[0] for r in ROUTES],  # two levels
        [[r] for r in ROUTES],  # four
    ],
)
def test_router_choices_that_are_no_regular_integer_array_stay_lists(routes: list[Any]) -> None:
    got = _same_as_json(_body([{"type": "message", "routed_experts": routes}]))
    assert _held(got) == []


@pytest.mark.parametrize(
    "text",
    [
        b"[[[0,1]],[[1, 2]]",  # a space
        b"[[[-0,1]],[[1,2]]",  # -0
        b"[[[1e0,1]],[[1,2]]",  # a float's form
        b"[[[1,1]],[[1,2,3]]",  # ragged at the second token
    ],
)
def test_text_that_is_not_orjsons_own_is_parsed_as_lists(text: bytes) -> None:
    """Only the exact text orjson writes of the array is held: any other spelling of the same numbers
    is parsed, and its lists written canonically (the digest is json's)."""
    tail = b"," + b",".join([b"[[1,2]]"] * TYPED_FROM_TOKENS) + b"]"
    body = b'{"id":"r","reward":1,"response":{"output":[{"routed_experts":' + text + tail + b"}]}}"
    assert routes_text(text + tail) is None
    assert _held(_same_as_json(body)) == []


def test_the_same_text_elsewhere_is_parsed_as_any_value() -> None:
    """Router choices' text outside an output item's `routed_experts` (in a string, escaped; under
    another key; as a key of the reply itself or of its metadata; twice in one item): the values are
    the standard library's."""
    text = orjson.dumps(ROUTES).decode()
    in_string = json.dumps({"a": f'"routed_experts":{text}'})  # the quotes escaped
    odd = '{"a": "x\\\\\\"routed_experts\\":' + text + '"}'  # an escaped quote after an escaped backslash
    assert json.loads(odd)["a"].startswith('x\\"routed_experts"')
    bodies = [
        _body([{"type": "message", "content": json.loads(in_string)["a"]}]),
        b'{"response":{"output":[' + odd.encode() + b"]}}",
        _body([], routed_experts=ROUTES),
        _body([{"type": "message", "metadata": {"routed_experts": ROUTES}}]),
        _body([{"type": "message", "routed_experts": ROUTES}], metadata={"routed_experts": ROUTES}),
        b'{"response":{"output":[{"routed_experts":' + text.encode() + b',"routed_experts":[[[9,9]]]}]}}',
        b'{"response":{"output":[{"routed_experts":[[[9,9]]],"routed_experts":' + text.encode() + b"}]}}",
        b'{"response":{"output":[{"routed_experts":' + text.encode() + b'}],"output":[]}}',
        b'{"response":{"output":{"routed_experts":' + text.encode() + b"}}}",
        b'[{"routed_experts":' + text.encode() + b"}]",
    ]
    for body in bodies:
        _same_as_json(body)
    assert held_routes._routes_in(bodies[0]) == [] and held_routes._routes_in(bodies[1]) == []


def test_router_choices_after_ones_refused_are_held() -> None:
    """A value refused whose text has no `]]]` of its own (its last token empty) does not hide the
    router choices after it, whose `]]]` the search for its end found."""
    got = _same_as_json(
        _body(
            [
                {"type": "message", "routed_experts": [*ROUTES, []]},
                {"type": "message", "routed_experts": ROUTES},
            ]
        )
    )
    assert [r.lists() for r in _held(got)] == [ROUTES]


def test_a_body_msgspec_refuses_is_refused_as_before() -> None:
    text = orjson.dumps(ROUTES)
    for body in (
        b'{"response":{"output":[{"routed_experts":' + text + b"}]}",  # unclosed
        b'{"response":{"output":[{"routed_experts":' + text + b"}]}} x",
    ):
        with pytest.raises(msgspec.DecodeError):
            decode_body(body)
        with pytest.raises(msgspec.DecodeError):
            msgspec.json.decode(body)


def test_the_processs_mark_in_a_body_is_an_agents_string() -> None:
    """A string an agent sends that begins as the marks this process cuts with (it cannot know the
    process's own) is a string like any other."""
    fake = "\x00routes-0123456789abcdef-0"
    got = _same_as_json(_body([{"routed_experts": fake}, {"routed_experts": ROUTES}]))
    assert got["response"]["output"][0]["routed_experts"] == fake and len(_held(got)) == 1


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1), st.integers(1, 3), st.booleans())
def test_any_reply_reads_as_the_standard_librarys_json(seed: int, calls: int, spaced: bool) -> None:
    """Generated replies (router choices regular and not, `TYPED_FROM_TOKENS` tokens and around it,
    dumped compact or with json's spaces): the values are json's, and the text is held exactly where
    the body holds a regular array's own text on an output item."""
    rng = random.Random(seed)
    output: list[Any] = []
    for i in range(calls):
        routes = _routes(rng, rng.choice([0, 3, TYPED_FROM_TOKENS - 1, TYPED_FROM_TOKENS, 300]))
        output += [{"type": "message", "id": f"m{i}", "routed_experts": routes}, {"type": "x", "n": i}]
    reply = {"id": "r", "reward": 0.5, "response": {"output": output}}
    body = json.dumps(reply).encode() if spaced else orjson.dumps(reply)
    got = _same_as_json(body)
    carried = [i["routed_experts"] for i in output if "routed_experts" in i]
    want = [] if spaced else [routes for routes in carried if routes_array(routes)]
    assert [r.lists() for r in _held(got)] == want
    assert same_json(run_json("http://agent", body), json.loads(body))


@pytest.mark.parametrize("levels_above", [MAX_JSON_DEPTH - 5, MAX_JSON_DEPTH - 4, MAX_JSON_DEPTH - 3])
def test_the_nesting_check_counts_held_text_as_its_three_levels(levels_above: int) -> None:
    """At the depth limit and one past it, router choices held as text get the verdict their lists
    get from the item-by-item walk."""
    held = routes_text(orjson.dumps(ROUTES))
    as_lists: Any = {"routed_experts": ROUTES}
    as_text: Any = {"routed_experts": held}
    for _ in range(levels_above):
        as_lists, as_text = {"k": as_lists}, {"k": as_text}
    want = walked_check_depth(as_lists, MAX_JSON_DEPTH, True)
    assert (want is None) == (levels_above < MAX_JSON_DEPTH - 3)  # 4 levels of its own, then the limit
    if want is None:
        assert check_depth(as_text, finite=True) is as_text
    else:
        with pytest.raises(ValueError) as got:
            check_depth(as_text, finite=True)
        assert str(got.value) == want


def test_held_text_is_immutable_and_unhashable_as_its_lists() -> None:
    routes = routes_text(orjson.dumps(ROUTES))
    assert routes is not None and len(routes) == len(ROUTES) and routes != ROUTES[:-1]
    with pytest.raises(AttributeError):
        routes.text = b"[]"
    with pytest.raises(TypeError):
        hash(routes)


def test_a_completion_frames_token_header_holds_its_router_choices_as_text() -> None:
    """The records a participant's frame carries (version 1: router choices in the header's JSON),
    read as the trainer reads a frame: their router choices held as text, the same records, and
    made into the same stored form as read as lists."""
    body = _body(
        [
            {
                "type": "message",
                "id": "m",
                "role": "assistant",
                "content": [],
                "prompt_token_ids": [1, 2],
                "generation_token_ids": list(range(len(ROUTES))),
                "generation_log_probs": [-0.5] * len(ROUTES),
                "routed_experts": ROUTES,
            }
        ]
    )
    reply = gym_reply(json.loads(body), "r-1", 0)
    v1 = encode_entries(token_records_from_reply(reply, "k", 1.0))
    as_text, as_lists = canonical_arrays(v1, routes_as_text=True), canonical_arrays(v1)
    assert type(as_text.records[0]["routed_experts"]) is RoutesText
    assert type(as_lists.records[0]["routed_experts"]) is list
    assert as_text.records == as_lists.records and as_text.buffer is v1
    output = reply_output_of(reply.payload())
    assert referred(v1, output, layout=as_text.layout) == referred(v1, output, layout=as_lists.layout)
