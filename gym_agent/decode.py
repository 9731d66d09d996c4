"""One model call's decode: its tokens generated over its duration, and cut at a token boundary when a
checkpoint asks its try to park (a generation-safe cut).

The call's duration (`gym_agent.durations`) is spread evenly over its tokens and spent in slices of at
most a heartbeat; after each slice the tokens due by then are generated and the call reports them
(`RunSession.heartbeat`, or `RunSession.at_cut` when the agent cuts).  A cut parks the try with that
prefix kept in the checkpoint's artefact; after the resume the call goes on from it: the rest of its
tokens are sampled after the prefix with the same generator, so a cut call's tokens, log
probabilities and time are those of the same call uncut.  Nothing is generated twice, nothing thrown
away, and the checkpoint waits at most one slice for the call instead of all of it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from participant.checkpoint import ActivePrefix

# The longest slice of a decode between two reports: what a cut makes a prepare wait at most
# (the agent promises a heartbeat every HEARTBEAT_S, twice a slice).
SLICE_S = 0.25

# (the call's tokens so far, how many more) -> (their ids, their log probabilities)
SampleMore = Callable[[list[int], int], Awaitable[tuple[list[int], list[float]]]]
Cut = Callable[[ActivePrefix], Awaitable[None]]
Heartbeat = Callable[..., None]


async def decode(
    total: int,
    seconds: float,
    sample_more: SampleMore,
    *,
    call_id: str,
    heartbeat: Heartbeat,
    at_cut: Cut | None = None,
) -> tuple[list[int], list[float]]:
    """Generates the call's `total` tokens over `seconds` of model time (parked time not counted).

    Model time is read off the event loop's clock, not summed from the slices asked for: on a busy
    loop every sleep overruns, and a call of 20 s would otherwise take 23."""
    loop = asyncio.get_running_loop()
    started, parked = loop.time(), 0.0
    ids: list[int] = []
    logprobs: list[float] = []
    while True:
        step = min(SLICE_S, seconds - (loop.time() - started - parked))
        if step > 0:
            await asyncio.sleep(step)
        spent = loop.time() - started - parked
        due = total if spent >= seconds else min(total, int(total * spent / seconds))
        if due > len(ids):
            more, more_logprobs = await sample_more(ids, due - len(ids))
            if ids:
                ids += more
                logprobs += more_logprobs
            else:  # the call's first tokens: their lists are the call's own (9,000 items not copied)
                ids, logprobs = more, more_logprobs
        if len(ids) >= total:
            return ids, logprobs
        if at_cut is not None:
            cut_at = loop.time()
            await at_cut(
                ActivePrefix(
                    model_call_id=call_id,
                    generation_token_ids=list(ids),
                    generation_log_probs=list(logprobs),
                    model_s=round(cut_at - started - parked, 6),
                )
            )
            parked += loop.time() - cut_at
        else:
            heartbeat(len(ids))
