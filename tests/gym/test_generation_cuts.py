"""Generation-safe cuts (gym_agent.decode, RunSession.at_cut): a checkpoint parks a try inside its
model call at a token boundary, the call's tokens so far are kept in the checkpoint's artefact, and
after the resume the call goes on from them: the try's reply is that of the same call uncut."""

from __future__ import annotations

import asyncio
import json
import time

from gym_agent.durations import Durations
from protocol.ids import capture_key
from protocol.wire import FEATURE_GENERATION_CUT
from tests.gym.conftest import MakeAgent, run_request, token_entries, wait_for
from trainer.gym import GymClient


async def test_a_checkpoint_cuts_a_model_call_and_the_call_goes_on_from_its_prefix(
    make_agent: MakeAgent,
) -> None:
    """One 3 s model call (the real tiny policy) under checkpoints until one cuts it: a checkpoint
    parks the try at its boundary before the call (then the call starts at the resume and the next
    checkpoint follows it at once) or inside the call, with the call's prefix in the artefact.  The
    test does not depend on where the first lands: how long the status polls or the first prepare
    took (a loaded machine) only decides whether the first or the second cuts it.  The reply equals a
    twin's that played the call straight through, the token record begins with the prefix, and the
    try's model time leaves out the time parked."""
    agent = make_agent(
        "cutter", turns=(1, 1), seed=5, call_seconds=Durations(mean_s=3.0), generation_cuts=True
    )
    rid = "cut1_g0"
    async with GymClient(agent.url, "cutter") as c:
        assert FEATURE_GENERATION_CUT in (await c.capabilities()).features
        began = time.monotonic()
        run = asyncio.create_task(c.run(run_request(rid)))
        await wait_for(lambda: _running(c))
        parked: dict[str, object] | None = None
        for ck in ("ck-a", "ck-b"):
            prepared = await c.prepare(ck, timeout_s=10)
            assert (prepared.status.parked, prepared.status.ready_to_commit) == (1, True)
            await c.commit(ck)
            artefact = json.loads(
                (agent.config.resolved_state_dir / "checkpoints" / f"{ck}.json").read_text()
            )
            [parked] = artefact["parked"]
            if parked["active_prefix"] is not None:
                await asyncio.sleep(1.0)  # held parked: not model time
                await c.resume(ck)
                break
            if ck == "ck-a":  # parked at its boundary before the call: the call starts at this resume
                assert parked["model_calls_done"] == 0
            await c.resume(ck)
        assert parked is not None
        prefix = parked["active_prefix"]
        assert isinstance(prefix, dict), f"no checkpoint cut the call: {parked}"
        assert prefix["model_call_id"] == "call-1"
        assert parked["model_calls_done"] == 0
        reply = await asyncio.wait_for(run, 60)
        wall = time.monotonic() - began
        [entry] = await token_entries(c, capture_key(rid, 0))
        receipt = await c.completion_receipt(rid, 0)
    n = len(prefix["generation_token_ids"])
    assert entry.generation_token_ids[:n] == prefix["generation_token_ids"]
    assert entry.generation_log_probs[:n] == prefix["generation_log_probs"]
    assert receipt.work is not None and receipt.work.generated_tokens == len(entry.generation_token_ids)
    assert prefix["model_s"] <= receipt.work.model_s <= wall - 1.0

    twin = make_agent("twin", turns=(1, 1), seed=5)
    async with GymClient(twin.url, "twin") as t:
        assert FEATURE_GENERATION_CUT not in (await t.capabilities()).features
        straight = await t.run(run_request(rid))
        [twin_entry] = await token_entries(t, capture_key(rid, 0))
    assert reply == straight
    assert twin_entry.generation_token_ids == entry.generation_token_ids
    assert twin_entry.generation_log_probs == entry.generation_log_probs


async def _running(c: GymClient) -> bool:
    return (await c.status()).running == 1
