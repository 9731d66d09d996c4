"""A completed try's `/run` answer carries its receipt and token records (`protocol.completion`): one
exchange per try instead of three, the same checks, and the old fetches for anything the answer lacks."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from eventstore import open_store
from gym_agent.server import ThreadAgent
from protocol.completion import (
    COMPLETION_MEDIA_TYPE,
    CompletionFrameError,
    decode_completion,
    encode_completion,
)
from protocol.ids import capture_key
from protocol.token_codec import encode_records
from protocol.wire import ALL_FEATURES, FEATURE_COMPLETION_IN_RUN, CompletionReceipt
from simulation.run import SimConfig, run_simulation
from tests.gym.conftest import fresh_id, run_request
from tests.gym.test_client import _with_transport
from trainer.gym import BadResponseError, GymClient, verify_receipt


def test_a_frame_round_trips_and_a_damaged_one_is_refused_in_one_line() -> None:
    frame = encode_completion(b'{"a":1}', b'{"b":2}', b"RLTK-tokens")
    parts = decode_completion(frame)
    assert (parts.reply, parts.receipt, bytes(parts.tokens)) == (b'{"a":1}', b'{"b":2}', b"RLTK-tokens")
    for damaged in (frame[:10], b"XXXX" + frame[4:], frame[:4] + b"\x02" + frame[5:], frame[:20]):
        with pytest.raises(CompletionFrameError) as caught:
            decode_completion(damaged)
        assert "\n" not in str(caught.value)


async def test_a_participant_answers_run_with_the_receipt_and_token_records_it_would_fetch(
    shared_agent: ThreadAgent,
) -> None:
    async with GymClient(shared_agent.url, shared_agent.config.name) as client:
        assert FEATURE_COMPLETION_IN_RUN in (await client.connect()).features
        rid = fresh_id("cir")
        done = await client.run_completed(run_request(rid))
        receipt, tokens = done.carried_receipt(), done.carried_tokens()
        assert receipt is not None and tokens is not None
        verify_receipt(done.reply, receipt)
        assert receipt == await client.completion_receipt(rid, 0)
        fetched = await client.token_capture(capture_key(rid, 0))
        assert bytes(tokens.buffer) == bytes(fetched.buffer)
        # A replay of the stored reply carries them too; the plain `run` asks for the reply alone.
        again = await client.run_completed(run_request(rid))
        assert again.receipt == done.receipt and again.reply == done.reply
        assert await client.run(run_request(rid)) == done.reply


async def test_an_agent_that_does_not_declare_it_is_not_asked(shared_agent: ThreadAgent) -> None:
    seen: list[bytes] = []

    class Recording(GymClient):
        async def _send(self, pool: Any, method: str, path: str, **kwargs: Any) -> Any:
            if path == "/run":
                seen.extend(v for k, v in kwargs.get("extra_headers", ()) if k.lower() == b"accept")
            return await super()._send(pool, method, path, **kwargs)

    async with Recording(shared_agent.url, shared_agent.config.name) as client:
        capabilities = await client.connect()
        client.capabilities_seen = capabilities.model_copy(
            update={"features": [f for f in capabilities.features if f != FEATURE_COMPLETION_IN_RUN]}
        )
        done = await client.run_completed(run_request(fresh_id("old")))
    assert done.receipt is None and done.tokens is None  # the caller fetches them, as from any older agent
    assert seen == []


def _receipt(rid: str, **changes: Any) -> dict[str, Any]:
    receipt = CompletionReceipt(
        rollout_id=rid,
        attempt_index=0,
        execution_generation=1,
        execution_incarnation="a" * 32,
        result_identity="res",
        result_digest="sha256:" + "0" * 64,
        manifest_capture_key=capture_key(rid, 0),
        terminal_model_call_id="call-0",
    )
    return receipt.model_dump(mode="json") | changes


def _tokens(key: str) -> bytes:
    record = {
        "rollout_id": key,
        "model_call_id": "call-0",
        "prompt_token_ids": [1, 2],
        "generation_token_ids": [3],
        "generation_log_probs": [-0.5],
    }
    return encode_records([record])


@pytest.mark.parametrize(
    ("receipt", "tokens", "kept"),
    [
        (lambda rid: orjson.dumps(_receipt(rid)), lambda key: _tokens(key), "both"),
        (lambda rid: b"{not json", lambda key: _tokens(key), "receipt refused"),
        (
            lambda rid: orjson.dumps(_receipt(rid, attempt_index=1)),
            lambda key: _tokens(key),
            "receipt refused",
        ),
        (lambda rid: orjson.dumps(_receipt(rid)), lambda key: b"RLTK garbage", "tokens refused"),
        (lambda rid: orjson.dumps(_receipt(rid)), lambda key: _tokens("another_key"), "tokens refused"),
    ],
    ids=["whole", "receipt-not-json", "receipt-of-another-try", "tokens-garbage", "tokens-of-another-key"],
)
async def test_a_part_of_the_answer_that_fails_its_check_is_refused_where_its_fetch_would_be(
    receipt: Any, tokens: Any, kept: str
) -> None:
    rid = "part_g0"
    reply = {"_ng_rollout_id": rid, "_ng_attempt_index": 0, "id": "res", "response": {}, "reward": 1.0}
    frame = encode_completion(orjson.dumps(reply), receipt(rid), tokens(capture_key(rid, 0)))

    def answer(request: httpx.Request) -> httpx.Response:
        assert COMPLETION_MEDIA_TYPE in request.headers["accept"]
        return httpx.Response(200, content=frame, headers={"content-type": COMPLETION_MEDIA_TYPE})

    client = _with_transport(GymClient("http://agent", "a"), answer)
    client.capabilities_seen = _capabilities()
    done = await client.run_completed(run_request(rid))
    assert done.reply.id == "res"  # the reply stands: what failed is refused when the caller takes it
    if kept == "receipt refused":
        with pytest.raises(BadResponseError, match="receipt"):
            done.carried_receipt()
        assert done.tokens is None
        return
    receipt = done.carried_receipt()
    assert receipt is not None and receipt.attempt == (rid, 0)
    if kept == "tokens refused":
        with pytest.raises(BadResponseError, match="token records"):
            done.carried_tokens()
        return
    tokens = done.carried_tokens()
    assert tokens is not None and tokens.model_call_ids == ["call-0"]


async def test_a_frame_that_does_not_parse_is_a_bad_answer_of_run() -> None:
    def answer(_: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"RLCP\x01", headers={"content-type": COMPLETION_MEDIA_TYPE})

    client = _with_transport(GymClient("http://agent", "a"), answer)
    client.capabilities_seen = _capabilities()
    with pytest.raises(BadResponseError, match="completion frame"):
        await client.run_completed(run_request("bad_g0"))


def _capabilities() -> Any:
    from protocol.wire import Capabilities

    return Capabilities(agent_name="a", execution_incarnation="a" * 32, features=list(ALL_FEATURES))


class CountingClient(GymClient):
    """Counts the calls each path gets (the token fetch bypasses `_send`: counted at `_exchange`)."""

    calls: Counter[str] = Counter()

    async def _exchange(self, pool: Any, method: str, path: str, **kwargs: Any) -> Any:
        CountingClient.calls[path.split("/")[1]] += 1
        return await super()._exchange(pool, method, path, **kwargs)


class OldAgentClient(CountingClient):
    """The same client facing agents that never declared `completion_in_run` (older participants)."""

    @property
    def completion_in_run(self) -> bool:
        return False


@pytest.mark.parametrize("client_class", [CountingClient, OldAgentClient], ids=["completion", "old-agent"])
async def test_a_run_seals_every_try_with_one_exchange_each_or_fetches_from_older_agents(
    make_agent: Any, tmp_path: Path, client_class: type[CountingClient]
) -> None:
    agents = {name: make_agent(name) for name in ("cir-a", "cir-b")}
    store = open_store(f"sqlite:///{tmp_path / 'cir.db'}", migrate_schema=True)
    config = SimConfig(
        agent_urls={name: agent.url for name, agent in agents.items()},
        groups=6,
        siblings=4,
        mode="prompt_group",
        faults="",
        checkpoint_every_s=0.0,
        rollout_timeout_s=30.0,
        turns=(1, 1),
        agent_delay_s=0.0,
        run_id=f"cir{client_class.__name__.lower()}",
    )
    CountingClient.calls = Counter()
    try:
        summary = await asyncio.wait_for(run_simulation(store, config, client_factory=client_class), 120)
    finally:
        store.close()
    assert summary["groups_sealed"] == 6 and summary["audit_violations"] == 0
    assert summary["stranded"] == 0 and summary["debts_outstanding"] == 0
    calls = CountingClient.calls
    assert calls["run"] == 24
    fetched = 0 if client_class is CountingClient else 24
    assert (calls["completion_receipt"], calls["token_capture"]) == (fetched, fetched), calls
