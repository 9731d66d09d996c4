"""A `/run` body as the trainer's client reads it (`trainer.gym.runs.run_json`: msgspec, in C): the
standard library's values for any JSON, the old refusal for what it refuses, and, in reduced mode,
the receipt, token records and canonical JSON made once as a participant's frame carries them.
Against a real HTTP server on loopback answering the bytes each test gives."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi import FastAPI, Request, Response
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.digests import json_canonical_bytes, same_json, sha256_digest
from protocol.token_codec import encoded_entries, referred, reply_output_of
from tests.gym.test_participant import row, serve
from trainer.gym import BadResponseError, GymClient
from trainer.gym.runs import run_json


def raw_agent(bodies: dict[str, bytes]) -> FastAPI:
    """A plain Gym agent (no `/capabilities`) answering each try's `/run` with the bytes given for it."""
    app = FastAPI()

    @app.post("/run")
    async def run(request: Request) -> Response:
        body = await request.json()
        return Response(bodies[body["_ng_rollout_id"]], media_type="application/json")

    return app


def _reply(response: str) -> bytes:
    return (
        b'{"responses_create_params": {"input": "hi"}, "reward": 1, "response": ' + response.encode() + b"}"
    )


# Every form of number and string JSON allows, a MoE reply's router choices, and two calls' arrays.
_FORMS = (
    '{"id": "resp", "n": [-0, 0, -0.0, 1E5, 0.1e1, 1e-400, 5e-324, 1.7976931348623157e308, 123456789012345678,'
    " 9223372036854775807, 18446744073709551615, -9223372036854775808, 12345678901234567890123.5],"
    ' "s": ["\\u00e9\\ud83d\\ude00", "\\u0000\\u001f\\"\\\\/", "é 😀"], "e": {}, "l": [[], [[]]],'
    ' "output": [{"type": "message", "id": "m", "role": "assistant", "content": [],'
    ' "prompt_token_ids": [1, 2], "generation_token_ids": [3, 151935], "generation_log_probs": [-1e-7, -0.25],'
    ' "routed_experts": [[[1, 2], [3, 4]], [[5, 6], [7, 0]]]}]}'
)


async def test_the_client_reads_the_standard_librarys_values_and_keeps_them_once() -> None:
    body = _reply(_FORMS)
    with serve(raw_agent({"f_g0": body})) as url:
        async with GymClient(url, "a") as client:
            await client.connect()
            assert client.reduced is not None
            done = await client.run_completed(row("f_g0"))
            # The reply as kept: the try's identity filled in, the reward a float (RunReply's field).
            want = json.loads(body) | {
                "_ng_rollout_id": "f_g0",
                "_ng_attempt_index": 0,
                "id": "resp",
                "reward": 1.0,
            }
            payload = done.reply.parsed_payload()
            assert same_json(payload, want) and json_canonical_bytes(payload) == json_canonical_bytes(want)
            # Reduced mode carries what a participant's frame would: made once, and what the fetches give.
            assert done.reply_json == json_canonical_bytes(want)
            receipt = done.carried_receipt()
            assert receipt == await client.completion_receipt("f_g0", 0)
            assert receipt.result_digest == sha256_digest(json_canonical_bytes(want)) == done.reply.digest()
            # The records carried already as they are stored beside the reply; the fetch answers them
            # in version 1, as a participant's `/token_capture` would.
            tokens = done.carried_tokens()
            assert tokens is not None
            v1, v1_layout = encoded_entries(client.reduced.token_capture("f_g0"))
            stored = referred(memoryview(v1), reply_output_of(payload), layout=v1_layout)
            assert (bytes(tokens.buffer), done.tokens_beside, tokens.layout) == stored
            fetched = await client.token_capture("f_g0")
            assert bytes(fetched.buffer) == v1
            for records in (tokens.records, fetched.records):
                assert records[0]["routed_experts"] == [[[1, 2], [3, 4]], [[5, 6], [7, 0]]]


@pytest.mark.parametrize(
    ("response", "needle"),
    [
        ('{"id": "r", "x": [1, 2, 1e999]}', "which JSON cannot carry"),  # read as infinity, then refused
        ('{"id": "r", "x": -1e400}', "which JSON cannot carry"),
        ('{"id": "r", "x": [[1, 18446744073709551616]]}', "outside the 64-bit range"),
        ('{"id": "r", "x": NaN}', "which JSON cannot carry"),
        ('{"id": "r", "x": [1, 2', "not JSON"),
    ],
    ids=["1e999", "-1e400", "integer-past-64-bits", "NaN", "truncated"],
)
async def test_a_body_the_fast_parse_refuses_gets_the_refusal_it_always_got(
    response: str, needle: str
) -> None:
    with serve(raw_agent({"b_g0": _reply(response)})) as url:
        async with GymClient(url, "a") as client:
            with pytest.raises(BadResponseError, match=needle) as refused:
                await client.run(row("b_g0"))
            assert "\n" not in str(refused.value)


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=4), inner, max_size=5),
    max_leaves=30,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_json, st.booleans())
def test_any_json_reads_as_the_standard_library_reads_it(value: Any, ascii_only: bool) -> None:
    body = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert same_json(run_json("http://127.0.0.1:9", body), json.loads(body))
