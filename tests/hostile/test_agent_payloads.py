"""Malformed, truncated, oversized and wrong-version payloads sent to a real agent.

Each is refused with a clear status and an `{"error", "message"}` body, and the agent's state (status
and real-execution counters) is exactly what it was before.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from gym_agent.faults import FaultRequest
from protocol.wire import MAX_BODY_BYTES, MAX_LIST_ITEMS, CompletionReceipt, RunRequest
from trainer.gym import GymClient

RECEIPT = {
    "schema_version": 1,
    "rollout_id": "p1_g0",
    "attempt_index": 0,
    "execution_generation": 1,
    "result_identity": "r-p1_g0",
    "result_digest": "sha256:" + "a" * 64,
    "manifest_capture_key": "p1_g0",
    "terminal_model_call_id": "call-1",
}


def ack(receipt: dict[str, Any], agent: str = "agent-a") -> dict[str, Any]:
    return {"executions": [{"agent_name": agent, "receipt": receipt}]}


RUN = {"_ng_rollout_id": "hostile", "_ng_attempt_index": 0}
DEEP = (
    b'{"_ng_rollout_id": "deep", "_ng_attempt_index": 0, "task": {"x": '
    + b"[" * 100_000
    + b"]" * 100_000
    + b"}}"
)

# (name, path, raw body, expected status)
CASES: list[tuple[str, str, bytes, int]] = [
    ("receipt schema_version 2", "/acknowledge", json.dumps(ack({**RECEIPT, "schema_version": 2})).encode(), 422),
    ("receipt schema_version 0", "/acknowledge", json.dumps(ack({**RECEIPT, "schema_version": 0})).encode(), 422),
    ("receipt schema_version '1'", "/acknowledge", json.dumps(ack({**RECEIPT, "schema_version": "1"})).encode(), 422),
    ("receipt without schema_version", "/acknowledge",
     json.dumps(ack({k: v for k, v in RECEIPT.items() if k != "schema_version"})).encode(), 200),
    ("receipt with an extra field", "/acknowledge", json.dumps(ack({**RECEIPT, "agent": "x"})).encode(), 422),
    ("receipt digest not sha256", "/acknowledge", json.dumps(ack({**RECEIPT, "result_digest": "md5:00"})).encode(), 422),
    ("receipt negative generation", "/acknowledge",
     json.dumps(ack({**RECEIPT, "execution_generation": -1})).encode(), 422),
    ("truncated JSON", "/acknowledge", json.dumps(ack(RECEIPT)).encode()[:-7], 422),
    ("truncated /run body", "/run", json.dumps(RUN).encode()[:20], 422),
    ("empty body", "/run", b"", 422),
    ("JSON null", "/run", b"null", 422),
    ("not UTF-8", "/run", b'{"_ng_rollout_id": "\xff\xfe", "_ng_attempt_index": 0}', 400),
    ("NaN timeout", "/checkpoint/prepare", b'{"checkpoint_id": "c", "timeout_s": NaN}', 422),
    ("Infinity timeout", "/checkpoint/prepare", b'{"checkpoint_id": "c", "timeout_s": Infinity}', 422),
    ("attempt index 10**100", "/run", b'{"_ng_rollout_id": "big", "_ng_attempt_index": 1' + b"0" * 100 + b"}", 422),
    ("attempt index as float", "/retire", b'{"rollout_id": "x", "attempt_index": 1e400}', 422),
    # Every id and index strict: nothing coerced (`true` ran try 1, "0" and 0.0 ran try 0).
    ("attempt index true", "/run", b'{"_ng_rollout_id": "strict1", "_ng_attempt_index": true}', 422),
    ("attempt index \"0\"", "/run", b'{"_ng_rollout_id": "strict2", "_ng_attempt_index": "0"}', 422),
    ("attempt index 0.0", "/run", b'{"_ng_rollout_id": "strict3", "_ng_attempt_index": 0.0}', 422),
    ("rollout id a number", "/run", b'{"_ng_rollout_id": 5, "_ng_attempt_index": 0}', 422),
    ("retire attempt index true", "/retire", b'{"rollout_id": "strict4", "attempt_index": true}', 422),
    ("receipt generation true", "/acknowledge", json.dumps(ack({**RECEIPT, "execution_generation": True})).encode(), 422),
    # Numbers JSON cannot carry, anywhere in a /run body: refused before anything runs.
    ("Infinity in the task", "/run", b'{"_ng_rollout_id": "nan1", "_ng_attempt_index": 0, "task": {"x": Infinity}}', 422),
    ("NaN in the params", "/run", b'{"_ng_rollout_id": "nan2", "_ng_attempt_index": 0, '
     b'"responses_create_params": {"temperature": NaN}}', 422),
    ("1e999 deep in the params", "/run", b'{"_ng_rollout_id": "nan3", "_ng_attempt_index": 0, '
     b'"responses_create_params": {"input": [{"content": [1, 2, 1e999]}]}}', 422),
    ("-Infinity in a row's own field", "/run", b'{"_ng_rollout_id": "nan4", "_ng_attempt_index": 0, '
     b'"_ng_task_index": -Infinity}', 422),
    ("NaN deep in a row's own field", "/run", b'{"_ng_rollout_id": "nan5", "_ng_attempt_index": 0, '
     b'"agent_ref": {"meta": [[NaN]]}}', 422),
    # Integers past 64 bits (orjson, which writes every reply, refuses them): refused before anything runs.
    ("2**90 in the params", "/run", b'{"_ng_rollout_id": "int1", "_ng_attempt_index": 0, '
     b'"responses_create_params": {"max_output_tokens": 1237940039285380274899124224}}', 422),
    ("-2**90 deep in a row's own field", "/run", b'{"_ng_rollout_id": "int2", "_ng_attempt_index": 0, '
     b'"floor": [false, null, -1237940039285380274899124224]}', 422),
    ("100,000-deep nesting", "/run", DEEP, 400),
    ("500-deep nesting in the task", "/run", b'{"_ng_rollout_id": "d500", "_ng_attempt_index": 0, "task": {"x": '
     + b"[" * 500 + b"]" * 500 + b"}}", 422),
    ("65-deep nesting in the params", "/run", b'{"_ng_rollout_id": "d65", "_ng_attempt_index": 0, '
     b'"responses_create_params": {"x": ' + b"[" * 64 + b"]" * 64 + b"}}", 422),
    ("list over the cap", "/acknowledge", json.dumps({"executions": [{"agent_name": "agent-a", "receipt": RECEIPT}] * (MAX_LIST_ITEMS + 1)}).encode(), 422),
    ("body over the cap", "/run",
     json.dumps({**RUN, "task": {"blob": "x" * (MAX_BODY_BYTES + 1)}}).encode(), 413),
]  # fmt: skip


async def _state(client: GymClient) -> tuple[object, object]:
    return (await client.status(), await client.debug_runs())


@pytest.mark.parametrize("name,path,body,expected", CASES, ids=[c[0] for c in CASES])
async def test_bad_payload_is_refused_and_changes_nothing(
    raw_a: httpx.AsyncClient,
    clients: tuple[GymClient, GymClient],
    name: str,
    path: str,
    body: bytes,
    expected: int,
) -> None:
    client = clients[0]
    before = await _state(client)
    answer = await raw_a.post(path, content=body, headers={"Content-Type": "application/json"})
    assert answer.status_code == expected, (name, answer.status_code, answer.text[:300])
    if expected == 200:
        # The version may be omitted (it defaults to the one version there is): an unknown try.
        assert answer.json()["results"][0]["error"] == "unknown_execution"
    else:
        error = answer.json()
        assert (
            error["error"] in ("invalid_request", "payload_too_large", "http_error") and error["message"]
        ), error
        assert len(answer.content) < 10_000  # the refusal does not echo the payload back
    assert await _state(client) == before


async def test_wrong_version_receipt_of_a_real_try_is_422_and_the_try_stays(
    raw_a: httpx.AsyncClient, clients: tuple[GymClient, GymClient]
) -> None:
    client = clients[0]
    reply = await client.run(RunRequest(rollout_id="wrongver", attempt_index=0))
    receipt = await client.completion_receipt(reply.rollout_id, 0)
    before = await _state(client)
    body = ack({**receipt.model_dump(mode="json"), "schema_version": 2})
    answer = await raw_a.post("/acknowledge", json=body)
    assert answer.status_code == 422 and "schema_version" in answer.json()["message"]
    assert await _state(client) == before
    [ok] = await client.acknowledge([receipt])
    assert ok.acknowledged and not ok.idempotent


def test_receipt_model_refuses_other_versions() -> None:
    for version in (0, 2, "1", None):
        with pytest.raises(ValidationError):
            CompletionReceipt.model_validate({**RECEIPT, "schema_version": version})


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=10,
)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(value=st.dictionaries(st.text(max_size=12), json_values, max_size=5) | json_values)
def test_fault_bodies_parse_or_refuse_cleanly(value: Any) -> None:
    """`/debug/faults` (left out of the HTTP fuzzing: crash_after ends the process) decodes in-process."""
    from pydantic import TypeAdapter

    adapter: TypeAdapter[Any] = TypeAdapter(FaultRequest)
    with contextlib.suppress(ValidationError):
        adapter.validate_python(value)
