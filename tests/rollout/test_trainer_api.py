"""What a NeMo RL-shaped trainer needs from the coordinator: replies from the log, an idempotent
submit, `metrics()` from the log, and logprobs it computed itself recorded as `LogprobsComputed`."""

from __future__ import annotations

import json
import math
from typing import Any

import orjson
import pytest

from eventstore import EventStore
from eventstore.events import PromptRef, RunReplied
from eventstore.payload_stores import payload_plane
from payloads import LocalDirPayloadStore
from payloads.replies import REPLY_APART_MEDIA_TYPE, REPLY_MEDIA_TYPE, put_arrays_back
from payloads.token_arrays import decode_arrays
from projections.audit import audit_log
from protocol.digests import canonical_bytes, sha256_digest
from protocol.streams import group_stream, logprobs_stream
from protocol.token_codec import TOKENS_MEDIA_TYPE, TOKENS_REPLY_MEDIA_TYPE
from protocol.tokens import TOKEN_FIELDS
from protocol.wire import AttemptFault
from tests.rollout.conftest import PAYLOAD, PROMPT, MakeAgent, coordinator, gid, one_sealed_group
from trainer import keep
from trainer.errors import GroupConflict, LogprobsMismatch
from trainer.gym import GymClient


async def test_sealed_groups_carry_the_replies_and_token_arrays_from_the_payload_plane(
    store: EventStore, make_agent: MakeAgent
) -> None:
    async with one_sealed_group(store, make_agent, "prompt_group", 3) as (_, sealed):
        pass
    assert len(sealed.replies) == 3
    for ref, reply, digest, reward in zip(
        sealed.attempts, sealed.replies, sealed.reply_digests, sealed.rewards, strict=True
    ):
        assert reply is not None
        assert reply["_ng_rollout_id"] == ref.rollout_id and reply["_ng_attempt_index"] == ref.attempt_index
        assert reply["reward"] == reward and "output" in reply["response"]
        # Content-addressed: the stored reply hashes to the digest the seal's RunReplied carries.
        blob = payload_plane(store).default.get(digest)
        assert sha256_digest(blob) == digest and json.loads(blob) == reply
    for tokens, claim, reply in zip(sealed.tokens, sealed.token_claims, sealed.replies, strict=True):
        # Stored beside the reply: the output items (the text) are the reply's, stored once, and
        # come back in the records read with it.
        assert tokens is not None and claim is not None and claim.media_type == TOKENS_REPLY_MEDIA_TYPE
        assert tokens.resolved and reply is not None
        output = reply["response"]["output"]
        assert all(h["output_items"] and all(i in output for i in h["output_items"]) for h in tokens.records)
        assert b"output_text" not in payload_plane(store).default.get(claim.digest)
        assert tokens.token_count == sum(tokens.generation(r).size for r in range(len(tokens))) > 0
    replied = [e for e in store.read_stream(group_stream(sealed.group_id)) if e.type == "RunReplied"]
    assert sorted(e.data["reply_digest"] for e in replied) == sorted(sealed.reply_digests)
    # `ledger audit` reads each try's records back with its reply.
    audit = audit_log(store, payloads=payload_plane(store))
    assert audit.ok, audit.as_json()


async def test_a_real_gym_agents_reply_is_stored_apart_from_its_records_arrays(
    store: EventStore, make_agent: MakeAgent
) -> None:
    """An agent that answers every call's token arrays inside its reply (`inline_tokens`, as a real
    Gym agent does): the reply is stored without them, they are in the records beside it, and the
    reply made whole is the one the agent's receipt names; training reads the arrays from the records."""
    async with one_sealed_group(store, make_agent, "prompt_group", 3, inline_tokens=True) as (_, sealed):
        pass
    plane = payload_plane(store)
    replied = {
        (e.data["rollout_id"], e.data["attempt_index"]): RunReplied.model_validate(e.data)
        for e in store.read_stream(group_stream(sealed.group_id))
        if e.type == "RunReplied"
    }
    for ref, claim, tokens_claim, reply, tokens, digest in zip(
        sealed.attempts,
        sealed.reply_claims,
        sealed.token_claims,
        sealed.replies,
        sealed.tokens,
        sealed.reply_digests,
        strict=True,
    ):
        assert claim is not None and tokens_claim is not None and reply is not None and tokens is not None
        assert (
            claim.media_type == REPLY_APART_MEDIA_TYPE and tokens_claim.media_type == TOKENS_REPLY_MEDIA_TYPE
        )
        assert replied[(ref.rollout_id, ref.attempt_index)].apart_from == tokens_claim
        stored = plane.default.get(claim.digest)
        assert b"generation_log_probs" not in stored and claim.digest != digest
        items = reply["response"]["output"]
        assert not any(set(TOKEN_FIELDS) & set(i) for i in items if isinstance(i, dict))
        made = put_arrays_back(orjson.loads(stored), plane.default.get(tokens_claim.digest))
        assert sha256_digest(canonical_bytes(made)) == digest  # the agent's reply, byte for byte
        carriers = [i for i in made["response"]["output"] if "generation_token_ids" in i]
        assert [i["generation_token_ids"] for i in carriers] == [
            tokens.generation(r).tolist() for r in range(len(tokens))
        ]
        assert tokens.resolved
    audit = audit_log(store, payloads=plane)
    assert audit.ok, audit.as_json()


@pytest.mark.parametrize("inline_tokens", [False, True], ids=["records apart", "arrays in the reply"])
async def test_the_reply_a_completion_frame_carries_is_stored_as_it_came(
    store: EventStore, make_agent: MakeAgent, monkeypatch: pytest.MonkeyPatch, inline_tokens: bool
) -> None:
    """A participant's `/run` answer carries the reply's canonical JSON: the trainer takes those bytes
    for the reply's (they hash to the receipt's digest) and writes no JSON of the reply itself; a reply
    carrying arrays is still stored apart, once its arrays are compared with its records'."""
    written: list[str] = []

    def counted(name: str) -> Any:
        real = getattr(keep, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            written.append(name)
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(keep, "canonical_bytes", counted("canonical_bytes"))
    async with one_sealed_group(store, make_agent, "prompt_group", 3, inline_tokens=inline_tokens) as (
        _,
        sealed,
    ):
        pass
    assert written == []
    plane = payload_plane(store)
    for claim, digest in zip(sealed.reply_claims, sealed.reply_digests, strict=True):
        assert claim is not None
        if inline_tokens:
            assert claim.media_type == REPLY_APART_MEDIA_TYPE and claim.digest != digest
        else:
            assert claim.media_type == REPLY_MEDIA_TYPE and claim.digest == digest
            assert sha256_digest(plane.default.get(digest)) == digest
    audit = audit_log(store, payloads=plane)
    assert audit.ok, audit.as_json()


async def test_submit_is_idempotent_and_refuses_a_different_request(
    store: EventStore, make_agent: MakeAgent
) -> None:
    agent = make_agent("a")
    async with GymClient(agent.url, "a") as client:
        coord = coordinator(store, {"a": client}, mode="sibling", rollout_timeout_s=60.0)
        async with coord:
            g = gid()
            first = await coord.submit(g, PROMPT, "a", 2, PAYLOAD)
            again = await coord.submit(g, PROMPT, "a", 2, PAYLOAD)
            assert first is not None and again is not None and again.group_id == g
            with pytest.raises(GroupConflict, match="expected_generations"):
                await coord.submit(g, PROMPT, "a", 3, PAYLOAD)
            with pytest.raises(GroupConflict, match="prompt_ref"):
                await coord.submit(g, PromptRef(sample_id="other", task_name="math"), "a", 2, PAYLOAD)
            await coord.wait_idle(120)
    types = [e.type for e in store.read_stream(group_stream(g))]
    assert types.count("GroupReserved") == 1 and types.count("AttemptMinted") == 2
    assert types.count("GroupSealed") == 1


async def test_a_resubmission_after_a_restart_resumes_the_open_group(
    store: EventStore, make_agent: MakeAgent
) -> None:
    """The first coordinator reserves and stops; a second one's submit of the same request drives it."""
    agent = make_agent("a")
    async with GymClient(agent.url, "a") as client:
        g = gid()
        first = coordinator(store, {"a": client}, mode="prompt_group", rollout_timeout_s=60.0)
        await first.start()
        await client.set_faults(AttemptFault(rollout_id=f"{g}_g0", attempt_index=0, delay_s=0.5))
        await first.submit(g, PROMPT, "a", 2, PAYLOAD)
        await first.close()
        second = await type(first).recover(store, {"a": client}, mode="prompt_group", rollout_timeout_s=60.0)
        async with second:
            group = await second.submit(g, PROMPT, "a", 2, PAYLOAD)
            assert group is not None
            await second.wait_idle(120)
            assert second.ledger.groups[g].status == "sealed"
    assert [e.type for e in store.read_stream(group_stream(g))].count("GroupReserved") == 1


async def test_metrics_is_a_flat_dict_folded_from_the_log(store: EventStore, make_agent: MakeAgent) -> None:
    agent = make_agent("a")
    async with GymClient(agent.url, "a") as client:
        coord = coordinator(store, {"a": client}, mode="prompt_group", rollout_timeout_s=60.0)
        async with coord:
            groups = [gid() for _ in range(2)]
            for g in groups:
                await coord.submit(g, PROMPT, "a", 2, PAYLOAD)
            await coord.wait_idle(120)
            outcome = await coord.checkpoint(gid("ck"))
            assert outcome.committed
            figures = await coord.metrics()
    assert all(isinstance(k, str) and isinstance(v, float) for k, v in figures.items())
    assert figures["ledger/groups_sealed"] == 2 and figures["ledger/groups_reserved"] == 2
    assert figures["ledger/checkpoints_committed"] == 1 and figures["ledger/unpaid_debts"] == 0
    assert figures["ledger/prepare_wait_count"] == 1 and figures["ledger/stranded"] == 0
    assert figures["journal/appends"] >= 1
    # A new process folds the same figures from the same log; the one event it adds is its own owner
    # epoch (TrainerEpochTaken), so only the log position moved.
    fresh = coordinator(store, {})
    await fresh.start()
    again = await fresh.metrics()
    await fresh.close()
    assert again["ledger/position"] == figures["ledger/position"] + 1
    assert [e.type for e in store.read_all(int(figures["ledger/position"]))] == ["TrainerEpochTaken"]
    assert {k: v for k, v in again.items() if k.startswith("ledger/") and k != "ledger/position"} == {
        k: v for k, v in figures.items() if k.startswith("ledger/") and k != "ledger/position"
    }


def _generation_logprobs(store: EventStore, tokens_digest: str) -> list[float]:
    arrays = decode_arrays(payload_plane(store).default.get(tokens_digest))
    return [float(v) for r in range(len(arrays)) for v in arrays.logprobs(r)]


async def test_trainer_logprobs_are_checked_and_recorded_once(
    store: EventStore, make_agent: MakeAgent
) -> None:
    pytest.importorskip("torch")
    from workers.logprobs import decode_logprobs, result_event_id

    async with one_sealed_group(store, make_agent, "sibling", 1, settle=False) as (coord, sealed):
        ref = sealed.attempts[0]
        reference = _generation_logprobs(store, sealed.tokens_digests[0])
        mine = [v - 0.25 for v in reference]
        with pytest.raises(LogprobsMismatch, match="logprobs for"):
            await coord.record_logprobs(ref.rollout_id, ref.attempt_index, mine[:-1], "v1")
        with pytest.raises(LogprobsMismatch, match="not finite"):
            await coord.record_logprobs(ref.rollout_id, ref.attempt_index, [math.nan] * len(mine), "v1")
        with pytest.raises(LogprobsMismatch, match="not sealed"):
            await coord.record_logprobs(ref.rollout_id, ref.attempt_index + 1, mine, "v1")
        assert await coord.record_logprobs(ref.rollout_id, ref.attempt_index, mine, "v1")
        # The same result again is a no-op; other numbers for the same try and version are refused.
        assert not await coord.record_logprobs(ref.rollout_id, ref.attempt_index, mine, "v1")
        with pytest.raises(LogprobsMismatch, match="another result"):
            await coord.record_logprobs(ref.rollout_id, ref.attempt_index, reference, "v1")
        await coord.wait_idle(120)
    [event] = list(store.read_stream(logprobs_stream(sealed.group_id)))
    assert event.type == "LogprobsComputed"
    assert event.event_id == str(result_event_id(ref.rollout_id, ref.attempt_index, "v1"))
    assert event.data["token_count"] == len(reference)
    assert event.data["max_abs_diff"] == pytest.approx(0.25, abs=1e-5)
    assert event.data["logprobs"]["digest"] == event.data["blob_digest"]
    blob = payload_plane(store).default.get(event.data["blob_digest"])
    assert decode_logprobs(blob).tolist() == pytest.approx(mine, abs=1e-6)


async def test_trainer_logprobs_refuse_tampered_token_records(
    sqlite_store: EventStore, make_agent: MakeAgent
) -> None:
    pytest.importorskip("torch")
    from eventstore.events import RolloutReceipt
    from trainer import own_logprobs

    store = sqlite_store
    async with one_sealed_group(store, make_agent, "sibling", 1) as (coord, sealed):
        ref = sealed.attempts[0]
        attempt = coord.ledger.attempt(ref.rollout_id, ref.attempt_index)
        assert attempt is not None and isinstance(attempt.rollout_receipt, RolloutReceipt)
        receipt = attempt.rollout_receipt
        n = receipt.token_count
        local = payload_plane(store).default
        assert isinstance(local, LocalDirPayloadStore)
        path = local.path_of(receipt.tokens_digest)
        blob = path.read_bytes()
        # The stored records altered under their digest: the read by claim refuses them.
        path.write_bytes(blob[:-1] + bytes([blob[-1] ^ 0x40]))
        with pytest.raises(LogprobsMismatch, match="hash to"):
            await coord.record_logprobs(ref.rollout_id, ref.attempt_index, [-1.0] * n, "v1")
        path.unlink()
        with pytest.raises(LogprobsMismatch, match="are not stored"):
            await coord.record_logprobs(ref.rollout_id, ref.attempt_index, [-1.0] * n, "v1")
    with pytest.raises(LogprobsMismatch, match="do not decode"):
        own_logprobs.decide(
            receipt, blob + b" ", TOKENS_MEDIA_TYPE, ref.rollout_id, ref.attempt_index, [-1.0] * n, "v1"
        )
