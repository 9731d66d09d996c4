"""What a NeMo RL-shaped trainer needs from the coordinator: replies from the log, an idempotent
submit, `metrics()` from the log, and logprobs it computed itself recorded as `LogprobsComputed`."""

from __future__ import annotations

import json
import math

import pytest

from eventstore import EventStore
from eventstore.events import PromptRef
from protocol.digests import sha256_digest
from protocol.streams import group_stream, logprobs_stream
from protocol.wire import AttemptFault, TokenEntry
from tests.rollout.conftest import PAYLOAD, PROMPT, MakeAgent, coordinator, gid
from trainer.errors import GroupConflict, LogprobsMismatch
from trainer.gym import GymClient


async def test_sealed_groups_carry_the_replies_from_the_blob_table(
    store: EventStore, make_agent: MakeAgent
) -> None:
    agent = make_agent("a")
    async with GymClient(agent.url, "a") as client:
        coord = coordinator(store, {"a": client}, mode="prompt_group", rollout_timeout_s=60.0)
        async with coord:
            g = gid()
            await coord.submit(g, PROMPT, "a", 3, PAYLOAD)
            [sealed] = [s async for s in coord.sealed_groups()]
            await coord.wait_idle(120)
    assert len(sealed.replies) == 3
    for ref, reply, digest, reward in zip(
        sealed.attempts, sealed.replies, sealed.reply_digests, sealed.rewards, strict=True
    ):
        assert reply is not None
        assert reply["_ng_rollout_id"] == ref.rollout_id and reply["_ng_attempt_index"] == ref.attempt_index
        assert reply["reward"] == reward and "output" in reply["response"]
        # Content-addressed: the blob hashes to the digest the seal's RunReplied carries.
        blob = store.get_blob(digest)
        assert blob is not None and sha256_digest(blob) == digest and json.loads(blob) == reply
    replied = [e for e in store.read_stream(group_stream(g)) if e.type == "RunReplied"]
    assert sorted(e.data["reply_digest"] for e in replied) == sorted(sealed.reply_digests)


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
    blob = store.get_blob(tokens_digest)
    assert blob is not None
    return [v for t in json.loads(blob) for v in TokenEntry.model_validate(t).generation_log_probs]


async def test_trainer_logprobs_are_checked_and_recorded_once(
    store: EventStore, make_agent: MakeAgent
) -> None:
    pytest.importorskip("torch")
    from workers.logprobs import decode_logprobs, result_event_id

    agent = make_agent("a")
    async with GymClient(agent.url, "a") as client:
        coord = coordinator(store, {"a": client}, mode="sibling", rollout_timeout_s=60.0)
        async with coord:
            g = gid()
            await coord.submit(g, PROMPT, "a", 1, PAYLOAD)
            [sealed] = [s async for s in coord.sealed_groups()]
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
    [event] = list(store.read_stream(logprobs_stream(g)))
    assert event.type == "LogprobsComputed"
    assert event.event_id == str(result_event_id(ref.rollout_id, ref.attempt_index, "v1"))
    assert event.data["token_count"] == len(reference)
    assert event.data["max_abs_diff"] == pytest.approx(0.25, abs=1e-5)
    blob = store.get_blob(event.data["blob_digest"])
    assert blob is not None
    assert decode_logprobs(blob).tolist() == pytest.approx(mine, abs=1e-6)


async def test_trainer_logprobs_refuse_tampered_token_records(
    sqlite_store: EventStore, make_agent: MakeAgent
) -> None:
    pytest.importorskip("torch")
    from eventstore.events import RolloutReceipt
    from trainer import own_logprobs

    store = sqlite_store
    agent = make_agent("a")
    async with GymClient(agent.url, "a") as client:
        coord = coordinator(store, {"a": client}, mode="sibling", rollout_timeout_s=60.0)
        async with coord:
            g = gid()
            await coord.submit(g, PROMPT, "a", 1, PAYLOAD)
            [sealed] = [s async for s in coord.sealed_groups()]
            await coord.wait_idle(120)
            ref = sealed.attempts[0]
            attempt = coord.ledger.attempt(ref.rollout_id, ref.attempt_index)
            assert attempt is not None and isinstance(attempt.rollout_receipt, RolloutReceipt)
            receipt = attempt.rollout_receipt
    blob = store.get_blob(receipt.tokens_digest)
    assert blob is not None
    n = receipt.token_count
    with pytest.raises(LogprobsMismatch, match="hash to"):
        own_logprobs.decide(receipt, blob + b" ", ref.rollout_id, ref.attempt_index, [-1.0] * n, "v1")
    with pytest.raises(LogprobsMismatch, match="not in the blob table"):
        own_logprobs.decide(receipt, None, ref.rollout_id, ref.attempt_index, [-1.0] * n, "v1")
