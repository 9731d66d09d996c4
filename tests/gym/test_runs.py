"""/run, replay, receipts and token capture against a real agent on loopback."""

from __future__ import annotations

import asyncio

import pytest

from gym_agent.server import ThreadAgent
from protocol.ids import capture_key
from protocol.wire import AttemptFault, FaultRates, RateFaults
from tests.gym.conftest import MakeAgent, fresh_id, run_request, token_entries, wait_for
from trainer.gym import ConnectionLostError, GoneError, GymClient, NotFoundError, verify_receipt


async def _is_running(client: GymClient, rollout_id: str) -> bool:
    return any(a.rollout_id == rollout_id for a in (await client.status()).blocking_attempts)


async def test_run_returns_a_reply_with_receipt_and_tokens(client: GymClient) -> None:
    rid = fresh_id("p") + "_g0"
    reply = await client.run(run_request(rid, 1))
    assert reply.id == f"r-{rid}-a1"
    assert (reply.rollout_id, reply.attempt_index, reply.mask_sample) == (rid, 1, False)
    assert 0.0 <= reply.reward <= 1.0
    # The row's own fields come back at the top level, as a Gym resources server echoes them.
    assert reply.model_extra == {"question_id": rid.split("_")[0]}

    receipt = await client.completion_receipt(rid, 1)
    verify_receipt(reply, receipt)
    assert receipt.manifest_capture_key == f"{rid}-a1"
    assert receipt.execution_generation == (await client.status()).execution_generation

    tokens = await token_entries(client, receipt.manifest_capture_key)
    assert [t.model_call_id for t in tokens] == [f"call-{i + 1}" for i in range(len(tokens))]
    assert receipt.terminal_model_call_id == tokens[-1].model_call_id
    assert reply.response["metadata"]["model_calls"] == len(tokens)
    for entry in tokens:
        assert entry.rollout_id == f"{rid}-a1"
        assert len(entry.generation_token_ids) == len(entry.generation_log_probs) > 0
        assert all(lp <= 0 for lp in entry.generation_log_probs)
        # The call's own output: one item, the one that carried the token arrays, as in the reply.
        assert entry.token_item_index == 0 and entry.output_items[0] in reply.response["output"]


async def test_same_seed_same_ids_same_episode(make_agent: MakeAgent) -> None:
    agents = [make_agent("twin-a", seed=3), make_agent("twin-b", seed=3), make_agent("other", seed=4)]
    results = []
    for agent in agents:
        async with GymClient(agent.url, agent.config.name) as c:
            reply = await c.run(run_request("p1_g0"))
            tokens = await token_entries(c, "p1_g0")
            results.append((reply, [(t.prompt_token_ids, t.generation_token_ids) for t in tokens]))
            receipt = await c.completion_receipt("p1_g0", 0)
            assert receipt.result_digest == reply.digest()
    (a, ta), (b, tb), (_, tc) = results
    assert a == b and ta == tb
    assert a.digest() == b.digest()
    assert tc != ta


async def test_siblings_share_the_prompt_but_not_the_samples(client: GymClient) -> None:
    group = fresh_id("p")
    await asyncio.gather(*(client.run(run_request(f"{group}_g{i}", task="same")) for i in range(2)))
    first = [await token_entries(client, f"{group}_g{i}") for i in range(2)]
    assert first[0][0].prompt_token_ids == first[1][0].prompt_token_ids
    assert first[0][0].generation_token_ids != first[1][0].generation_token_ids


async def test_replay_of_a_completed_try_does_not_run_it_again(client: GymClient) -> None:
    rid = fresh_id()
    first = await client.run(run_request(rid))
    again = await client.run(run_request(rid))
    assert again == first
    assert (await client.debug_runs())[rid] == 1


async def test_a_resent_run_of_a_running_try_waits_for_the_same_execution(client: GymClient) -> None:
    rid = fresh_id()
    await client.set_faults(AttemptFault(rollout_id=rid, attempt_index=0, delay_s=0.1))
    replies = await asyncio.gather(*(client.run(run_request(rid)) for _ in range(3)))
    assert replies[0] == replies[1] == replies[2]
    assert (await client.debug_runs())[rid] == 1


async def test_drop_reply_breaks_the_connection_and_keeps_the_reply(client: GymClient) -> None:
    rid = fresh_id("rD")
    await client.set_faults(AttemptFault(rollout_id=rid, attempt_index=0, drop_reply=True))
    with pytest.raises(ConnectionLostError):
        await client.run(run_request(rid))
    status = await client.status()
    assert status.completed_unacknowledged >= 1
    reply = await client.run(run_request(rid))
    verify_receipt(reply, await client.completion_receipt(rid, 0))
    assert (await client.debug_runs())[rid] == 1


async def test_environment_failure_is_a_masked_completed_result(client: GymClient) -> None:
    rid = fresh_id()
    await client.set_faults(AttemptFault(rollout_id=rid, attempt_index=0, fail=True))
    reply = await client.run(run_request(rid))
    assert reply.mask_sample is True
    assert reply.reward == 0.0
    receipt = await client.completion_receipt(rid, 0)  # still COMPLETED: it needs an ACK
    [result] = await client.acknowledge([receipt])
    assert result.acknowledged


async def test_rate_faults_are_deterministic_given_their_seed(make_agent: MakeAgent) -> None:
    masked: list[list[str]] = []
    for name in ("rates-a", "rates-b"):
        agent = make_agent(name)
        async with GymClient(agent.url, name) as c:
            await c.set_faults(RateFaults(rates=FaultRates(fail=0.5), seed=7))
            replies = await asyncio.gather(*(c.run(run_request(f"q{i}")) for i in range(16)))
            masked.append([r.rollout_id for r in replies if r.mask_sample])
    assert masked[0] == masked[1]
    assert 0 < len(masked[0]) < 16


async def test_receipt_of_an_unknown_or_unfinished_try_is_404(client: GymClient) -> None:
    rid = fresh_id()
    with pytest.raises(NotFoundError):
        await client.completion_receipt(rid, 0)
    with pytest.raises(NotFoundError):
        await client.token_capture(capture_key(rid, 0))
    # A hung try is unfinished for as long as the test needs, however slowly it is scheduled.
    await client.set_faults(AttemptFault(rollout_id=rid, attempt_index=0, hang=True))
    task = asyncio.create_task(client.run(run_request(rid)))
    await wait_for(lambda: _is_running(client, rid))
    with pytest.raises(NotFoundError):
        await client.completion_receipt(rid, 0)
    assert (await client.retire(rid, 0)).retired
    with pytest.raises(GoneError):
        await task


async def test_acknowledged_try_is_gone(client: GymClient) -> None:
    rid = fresh_id()
    await client.run(run_request(rid))
    await client.acknowledge([await client.completion_receipt(rid, 0)])
    with pytest.raises(GoneError):
        await client.run(run_request(rid))
    with pytest.raises(GoneError):
        await client.completion_receipt(rid, 0)
    # The token records are released with the reply: the trainer keeps its copy in the log.
    with pytest.raises(GoneError):
        await client.token_capture(rid)


async def test_capabilities_and_health(client: GymClient, shared_agent: ThreadAgent) -> None:
    caps = await client.capabilities()
    assert caps.agent_name == "shared"
    assert set(caps.features) == {
        "checkpoint_participation",
        "completed_result_acknowledgement",
        "retire",
        "token_capture",
        "completion_in_run",
        "carry_completed",
    }
    health = await client.health()
    assert health.execution_generation == shared_agent.generation


async def test_capture_key_collision_is_refused(client: GymClient) -> None:
    rid = fresh_id()
    await client.run(run_request(rid, 1))  # filed under "<rid>-a1"
    from trainer.gym import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="collides"):
        await client.run(run_request(f"{rid}-a1", 0))
