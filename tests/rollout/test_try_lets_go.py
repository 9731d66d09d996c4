"""A try lets go of its `/run` answer (the reply, the HTTP body, the token records) once its payloads
are stored: none of it is held while the seal's append waits for the journal (the trainer's heap
otherwise holds a window of answers, freed in bursts)."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from eventstore import EventStore
from eventstore.events import RunReplied
from tests.rollout.conftest import PAYLOAD, PROMPT, MakeAgent, coordinator, gid
from trainer.gym import Completed, GymClient


class Recording(GymClient):
    """Keeps every `/run` answer it returns, so the test can see who else still holds it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.answers: list[Completed] = []

    async def run_completed(self, *args: Any, **kwargs: Any) -> Completed:
        answer = await super().run_completed(*args, **kwargs)
        self.answers.append(answer)
        return answer


async def test_a_stored_try_holds_none_of_its_answer_while_its_seal_waits(
    store: EventStore, make_agent: MakeAgent
) -> None:
    agent = make_agent("a")
    client = Recording(agent.url, "a")
    async with client:
        coord = coordinator(store, {"a": client}, mode="sibling", rollout_timeout_s=60.0)
        async with coord:
            journal = coord._journal
            append = journal.append
            sealing, release = asyncio.Event(), asyncio.Event()

            async def gated(stream: str, build: Any, *args: Any, **kwargs: Any) -> list[Any]:
                # The seal's append (the one that decides its events against the ledger and records the
                # reply; deciding is pure, so asking here changes nothing): held until the test looked.
                if callable(build) and any(isinstance(e, RunReplied) for e in build(journal.ledger)):
                    sealing.set()
                    async with asyncio.timeout(60):
                        await release.wait()
                return await append(stream, build, *args, **kwargs)

            journal.append = gated  # type: ignore[method-assign]
            await coord.submit(gid(), PROMPT, "a", 1, PAYLOAD)
            async with asyncio.timeout(60):
                await sealing.wait()
            [answer] = client.answers
            assert answer.tokens is not None and not isinstance(answer.tokens, Exception)  # carried
            # Counted outside the assert (pytest's rewriting would hold the attributes once more). The
            # answer: the test's list, its local and getrefcount's argument; the reply and the records:
            # the answer and the argument.  Nothing of the trainer holds any of them.
            held = (sys.getrefcount(answer), sys.getrefcount(answer.reply), sys.getrefcount(answer.tokens))
            assert held == (3, 2, 2)
            release.set()
            [sealed] = [s async for s in coord.sealed_groups()]
            # What it let go of was stored: the seal reads the reply back, byte for byte the answer's.
            assert sealed.replies is not None and sealed.replies[0] is not None
            assert sealed.replies[0]["reward"] == answer.reply.reward
