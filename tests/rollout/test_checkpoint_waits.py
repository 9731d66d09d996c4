"""A checkpoint waits for model calls in progress, judges a try by its own progress, and retires one
only as its last resort, at most once per rollout (trainer.core.blocking), against real agents.

Each test starts the checkpoint once its try is running (a gate on the agent's /status), and the
agent's model calls are long (seconds) next to the coordinator's default park grace (1 s).
"""

from __future__ import annotations

import asyncio
from typing import Any

from eventstore import EventStore
from projections.generation import GENERATION_EVENTS, generation_figures
from protocol.wire import AttemptFault
from tests.rollout.conftest import PAYLOAD, PROMPT, MakeAgent, coordinator, gid
from trainer.gym import GymClient


def group_events(store: EventStore, group_id: str) -> list[tuple[str, dict[str, Any]]]:
    return [(e.type, e.data) for e in store.read_stream(f"group-{group_id}")]


async def _running(client: GymClient, rollout_id: str, attempt_index: int = 0) -> None:
    async with asyncio.timeout(30):
        while not any(
            (a.rollout_id, a.attempt_index) == (rollout_id, attempt_index)
            for a in (await client.status()).blocking_attempts
        ):
            await asyncio.sleep(0.02)


async def test_a_checkpoint_waits_for_a_long_model_call_instead_of_retiring_it(
    sqlite_store: EventStore, make_agent: MakeAgent
) -> None:
    """A 3 s model call under the default 1 s park grace: the try heartbeats, so the checkpoint waits
    for it to finish and commits; nothing is cancelled, the first try is the one sealed."""
    agent = make_agent("a", turns=(1, 1))
    async with GymClient(agent.url, "a") as client:
        g = gid()
        await client.set_faults(AttemptFault(rollout_id=f"{g}_g0", attempt_index=0, delay_s=3.0))
        coord = coordinator(sqlite_store, {"a": client}, mode="sibling", prepare_timeout_s=60)
        async with coord:
            await coord.submit(g, PROMPT, "a", 1, PAYLOAD)
            await _running(client, f"{g}_g0")
            outcome = await coord.checkpoint(gid("ck"))
            assert outcome.committed, outcome.reason
            assert outcome.retired == 0
            await coord.wait_idle(30)
        events = group_events(sqlite_store, g)
        # Nothing cancelled: a try that finished while the prepare waited may be adopted
        # (completed_unacknowledged), never retired.
        assert [
            d["outcome"]
            for t, d in events
            if t == "AttemptRetired" and d["outcome"] != "completed_unacknowledged"
        ] == []
        assert [d["attempt_index"] for t, d in events if t == "SiblingSealed"] == [0]


async def test_a_try_stuck_inside_a_model_call_is_retired_as_stalled(
    sqlite_store: EventStore, make_agent: MakeAgent
) -> None:
    """A hung try reports no progress: past its agent's promise it is retired, cause `stalled`, naming
    the checkpoint and the work it had done; the checkpoint commits and the replacement seals."""
    agent = make_agent("a", turns=(1, 1))
    async with GymClient(agent.url, "a") as client:
        g = gid()
        await client.set_faults(AttemptFault(rollout_id=f"{g}_g0", attempt_index=0, hang=True))
        coord = coordinator(sqlite_store, {"a": client}, mode="sibling", prepare_timeout_s=60)
        async with coord:
            await coord.submit(g, PROMPT, "a", 1, PAYLOAD)
            await _running(client, f"{g}_g0")
            ck = gid("ck")
            outcome = await coord.checkpoint(ck)
            assert outcome.committed, outcome.reason
            assert outcome.retired == 1
            await coord.wait_idle(30)
        events = group_events(sqlite_store, g)
        [retired] = [d for t, d in events if t == "AttemptRetired"]
        assert (retired["outcome"], retired["cause"], retired["checkpoint_id"]) == (
            "cancelled",
            "stalled",
            ck,
        )
        assert retired["work"]["model_s"] > 0 and retired["work"]["generated_tokens"] == 0
        [replacement] = [d for t, d in events if t == "ReplacementMinted"]
        assert replacement["reason"].startswith("stalled: no progress of its own")
        assert [d["attempt_index"] for t, d in events if t == "SiblingSealed"] == [1]


async def test_the_last_resort_retires_a_rollout_once_and_spends_no_budget(
    sqlite_store: EventStore, make_agent: MakeAgent
) -> None:
    """Calls longer than the prepare timeout: the first checkpoint retires the try just before its
    deadline (cause `checkpoint`) and commits; the replacement is protected, so the second checkpoint
    waits for it and aborts at its deadline instead of cancelling it again.  With max_tries=1 the
    rollout still seals: a try lost to a checkpoint spends no budget."""
    agent = make_agent("a", turns=(1, 1))
    async with GymClient(agent.url, "a") as client:
        g = gid()
        rid = f"{g}_g0"
        await client.set_faults(AttemptFault(rollout_id=rid, attempt_index=0, delay_s=60.0))
        await client.set_faults(AttemptFault(rollout_id=rid, attempt_index=1, delay_s=6.0))
        coord = coordinator(sqlite_store, {"a": client}, mode="sibling", prepare_timeout_s=2.0, max_tries=1)
        async with coord:
            await coord.submit(g, PROMPT, "a", 1, PAYLOAD)
            await _running(client, rid)
            first = gid("ck")
            outcome = await coord.checkpoint(first)
            assert outcome.committed, outcome.reason
            assert outcome.retired == 1
            await _running(client, rid, 1)
            second = await coord.checkpoint(gid("ck"))
            assert not second.committed
            assert "whose rollouts already lost 1 to checkpoints" in second.reason
            await coord.wait_idle(60)
        events = group_events(sqlite_store, g)
        [retired] = [d for t, d in events if t == "AttemptRetired"]
        assert (retired["attempt_index"], retired["cause"], retired["checkpoint_id"]) == (
            0,
            "checkpoint",
            first,
        )
        assert [d["attempt_index"] for t, d in events if t == "SiblingSealed"] == [1]
        assert "GroupDeadLettered" not in [t for t, _ in events]
        # The cost in sight, from the log: the retired try's work, as its agent measured it, is what
        # the first checkpoint threw away; the model time is both tries'.
        figures = generation_figures(sqlite_store.read_all(0, types=GENERATION_EVENTS))
        [receipt] = [d["receipt"] for t, d in events if t == "ReceiptFetched"]
        assert retired["work"]["model_s"] > 1.0  # it ran to the last resort, 2 s into the prepare
        assert figures.by_checkpoint[first].model_s == retired["work"]["model_s"]
        assert figures.thrown.tries == 1
        assert figures.total.model_s == retired["work"]["model_s"] + receipt["work"]["model_s"]
        assert (
            figures.total.tokens == retired["work"]["generated_tokens"] + receipt["work"]["generated_tokens"]
        )
