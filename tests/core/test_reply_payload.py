"""`RunReply.parsed_payload()`: for a reply read off JSON it is `payload()`, value for value and byte
for byte in canonical JSON, with its JSON-valued fields shared instead of copied."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.digests import canonical_bytes
from protocol.wire import RunReply, gym_reply
from tests.hostile.test_event_decoding import json_values


@settings(max_examples=300, deadline=None)
@given(
    response=st.dictionaries(st.text(max_size=6), json_values, max_size=5),
    params=st.none() | st.dictionaries(st.text(max_size=6), json_values, max_size=3),
    reward=st.integers(-5, 5) | st.floats(-10, 10),
    extras=st.dictionaries(st.sampled_from(["instance_config", "task", "x"]), json_values, max_size=2),
    mask=st.none() | st.booleans(),
    with_identity=st.booleans(),
)
def test_a_reply_read_off_json_has_its_payload_without_a_copy(
    response: dict[str, Any],
    params: dict[str, Any] | None,
    reward: float,
    extras: dict[str, Any],
    mask: bool | None,
    with_identity: bool,
) -> None:
    body: dict[str, Any] = {"response": response, "reward": reward, **extras}
    if params is not None:
        body["responses_create_params"] = params
    if mask is not None:
        body["mask_sample"] = mask
    if with_identity:
        body.update(_ng_rollout_id="r_g0", _ng_attempt_index=1, id="res-1")
    raw = orjson.dumps(body)
    replies = [gym_reply(orjson.loads(raw), "r_g0", 1)]
    if with_identity:  # a participant's reply names its try itself
        replies.append(RunReply.model_validate_json(raw))
    for reply in replies:
        parsed = reply.parsed_payload()
        assert parsed == reply.payload()
        assert canonical_bytes(parsed) == canonical_bytes(reply.payload())
        assert parsed["response"] is reply.response  # shared: nothing copied
        assert ("responses_create_params" in parsed) == (params is not None)
