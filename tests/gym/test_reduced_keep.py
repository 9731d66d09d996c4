"""Reduced mode's keep at real sizes (`trainer.gym.reduced.ReducedMode.keep`, which makes the token
records' stored form straight from the reply, then `reply_to_store`): a plain Gym agent's reply of up
to three model calls, hundreds of tokens each, float32 and float64 logprobs with orjson's small-float
forms, router choices regular and not (past int16 or int32, ragged, a float or a boolean among
them), and the arrays edited as an agent might write them.  Whatever the reply, its canonical JSON is
json's; the stored form is the one the records' version 1 form is made to refer to the reply
(`referred`), byte for byte; the records read back from it are the records kept; and a reply stored
apart from its arrays is made whole byte for byte."""

from __future__ import annotations

import random
import struct
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from payloads.replies import REPLY_APART_MEDIA_TYPE, REPLY_MEDIA_TYPE, put_arrays_back, reply_to_store
from payloads.token_arrays import canonical_arrays
from protocol.digests import canonical_bytes, json_canonical_bytes, sha256_digest, written_once
from protocol.ids import capture_key
from protocol.token_codec import (
    ROUTES_VERSION,
    TOKENS_MEDIA_TYPE,
    TOKENS_ROUTES_MEDIA_TYPE,
    decode_any,
    encoded_entries,
    read_layout,
    referred,
    reply_output_of,
)
from protocol.wire import gym_reply
from trainer.gym.reduced import ReducedMode
from trainer.gym.runs import run_json

_SIZES = (0, 1, 63, 64, 65, 700)  # around `TYPED_FROM_TOKENS`, and a real call's hundreds
_SMALL_FORMS = (-0.0, 0.0, -1e-7, -1.5e-5, -0.00001234, -1e-9, -9.99999e-5, -1.0000000000000002e-05)


def _float32(x: float) -> float:
    return float(struct.unpack("<f", struct.pack("<f", x))[0])


def _logprob(rng: random.Random) -> float:
    k = rng.random()
    if k < 0.6:
        return _float32(-rng.random() * 10 ** rng.randint(-9, 1))
    if k < 0.8:
        return rng.choice(_SMALL_FORMS)
    return -rng.random() * 30  # not a float32


def _routes(rng: random.Random, n: int) -> list[Any]:
    layers, k = rng.choice([(1, 2), (2, 4), (3, 1)])
    routes: list[Any] = [[[rng.randint(0, 127) for _ in range(k)] for _ in range(layers)] for _ in range(n)]
    if n:
        at = rng.randrange(n)
        edit = rng.choice(["none", "none", "int32", "int16", "ragged", "float", "bool", "empty"])
        if edit == "int32":
            routes[at][0][0] = 2**31 + 3
        elif edit == "int16":
            routes[at][0][0] = -40_000
        elif edit == "ragged":
            routes[at][0] = routes[at][0][:-1] or [1, 2, 3]
        elif edit == "float":
            routes[at][0][0] = 1.0
        elif edit == "bool":
            routes[at][0][0] = True
        elif edit == "empty":
            routes[at] = []
    return routes


def _item(rng: random.Random, kind: str, i: int, prompt: int) -> tuple[dict[str, Any], bool]:
    """A model call's output item carrying its arrays, and whether its arrays were edited."""
    n = rng.choice(_SIZES)
    item: dict[str, Any] = {"type": kind, "id": f"item-{i}", "status": "completed"}
    if kind == "message":
        text = rng.choice(["ok", "0.00001", "e-7 x", "\u00e9", "1e-05"])
        item |= {"role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": []}]}
    else:
        item |= {"call_id": f"call-{i}", "name": "lookup", "arguments": '{"q": 1}'}
    item["prompt_token_ids"] = [rng.randint(0, 150_000) for _ in range(prompt)]
    item["generation_token_ids"] = [rng.randint(0, 150_000) for _ in range(n)]
    item["generation_log_probs"] = [_logprob(rng) for _ in range(n)]
    if rng.random() < 0.7:
        item["routed_experts"] = _routes(rng, n)
    edit = rng.choice(["none"] * 6 + ["int logprob", "bool id", "wide id"])
    if edit == "int logprob" and n:
        item["generation_log_probs"][rng.randrange(n)] = rng.choice([0, -1, -3])
    elif edit == "bool id" and n:
        item["generation_token_ids"][rng.randrange(n)] = True
    elif edit == "wide id":
        item["prompt_token_ids"][0] = 2**33
    else:
        edit = "none"
    return item, edit != "none"


def _reply_body(rng: random.Random) -> tuple[bytes, bool]:
    """A plain Gym agent's `/run` body, and whether any arrays were edited."""
    output: list[dict[str, Any]] = []
    prompt, edited = rng.choice([1, 10, 1_000]), False
    for i in range(rng.randint(1, 3)):
        item, changed = _item(rng, rng.choice(["message", "function_call"]), i, prompt)
        output.append(item)
        edited |= changed
        prompt += len(item["generation_token_ids"]) + 5
        if item["type"] == "function_call":
            output.append({"type": "function_call_output", "call_id": f"call-{i}", "output": "42"})
    response = {"id": "resp-1", "model": "m", "object": "response", "created_at": 1.0, "output": output}
    row = {"input": [{"role": "user", "content": "q"}]}
    return orjson.dumps({"responses_create_params": row, "response": response, "reward": 1.0}), edited


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.randoms(use_true_random=False))
def test_reduced_mode_keeps_a_real_size_reply_exactly(rng: random.Random) -> None:
    body, edited = _reply_body(rng)
    reduced = ReducedMode("plain_agent")
    with written_once():  # as the trainer's intake takes a reply in
        reply = gym_reply(run_json("http://agent", body), "r-1", 0)
        kept = reduced.keep(reply)
    payload = reply.parsed_payload()
    assert kept.reply_json == json_canonical_bytes(payload)
    assert kept.receipt.result_digest == sha256_digest(kept.reply_json)
    held = [entry.record() for entry in reduced.token_capture(capture_key("r-1", 0))]
    if not kept.layout.records:  # arrays no record can hold (a boolean id): nothing to seal
        assert edited and held == [] and kept.media_type == TOKENS_MEDIA_TYPE
        return
    # Made straight from the records, the form is the one the records' version 1 form is made to refer
    # to the reply: the same bytes, media type and layout.
    entries = reduced.token_capture(capture_key("r-1", 0))
    v1, v1_layout = encoded_entries(entries)
    assert reduced.token_bytes(capture_key("r-1", 0)) == v1  # what an adoption's fetch reads
    stored_tokens, media_type, layout = kept.tokens, kept.media_type, kept.layout
    assert referred(memoryview(v1), reply_output_of(payload), layout=v1_layout) == (
        kept.tokens,
        media_type,
        layout,
    )
    # A participant's completion frame carries version 1: read as the trainer reads one (its router
    # choices held as their text, never lists), it is made into the same stored form.
    framed = canonical_arrays(v1, routes_as_text=True)
    assert canonical_bytes(framed.records) == canonical_bytes(v1_layout.records)
    assert referred(memoryview(v1), reply_output_of(payload), layout=framed.layout) == (
        kept.tokens,
        media_type,
        layout,
    )
    read = read_layout(stored_tokens, check_canonical=True)
    assert (read.records, read.spans, read.reply_items) == (layout.records, layout.spans, layout.reply_items)
    assert canonical_bytes(decode_any(stored_tokens, media_type, payload)) == canonical_bytes(held)
    if media_type == TOKENS_ROUTES_MEDIA_TYPE:
        assert read.version == ROUTES_VERSION and any(r is not None for r in read.routes)
    stored, stored_type = reply_to_store(payload, kept.reply_json, stored_tokens, media_type, layout)
    if stored_type == REPLY_APART_MEDIA_TYPE:
        assert canonical_bytes(put_arrays_back(orjson.loads(stored), stored_tokens)) == kept.reply_json
    else:
        assert stored_type == REPLY_MEDIA_TYPE and stored == kept.reply_json
        assert edited  # a reply whose items are its records' own is always stored apart
