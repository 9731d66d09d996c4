"""The simulated environment: a deterministic multi-turn episode whose model calls sample a real policy.

Everything random in an episode comes from seeds derived from (agent seed, rollout id, lineage) and,
per turn, the turn's number; the prompt from the task payload.  So the same seed and ids give the same
tokens, reward and reply digest, and a try that resumes a continuation (docs/turns.md) plays the turns
after it from the same seeds its lineage would have.  A try that plays from its prompt is a lineage of
its own (its capture key).  Siblings of a prompt group share their task, hence their prompt, but not
their samples.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import random
import struct
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import Executor
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from pydantic import BaseModel, ConfigDict, Field

from gym_agent.decode import Cut, Heartbeat, SampleMore, decode
from gym_agent.durations import Durations
from gym_agent.faults import ResolvedFault
from gym_agent.sizes import DEFAULT_GEN_TOKENS, DEFAULT_PROMPT_TOKENS, size_range
from gym_agent.tools import ToolBelt
from protocol.digests import canonical_json
from protocol.ids import capture_key
from protocol.lineage import link_call
from protocol.token_codec import with_arrays
from protocol.tokens import request_input, with_token_arrays
from protocol.wire import (
    TOKEN_SCHEMA_VERSION,
    ContinuationRef,
    ResourceRevision,
    RunReply,
    RunRequest,
    TokenEntry,
)
from workers.policy import Policy

MODEL_NAME = "policy"
OBSERVATION_LEN = (2, 6)
# Zero-work mode (benchmarks): a model call's tokens are drawn at its size, no model runs.  They are
# drawn to look like a real model's, so that what the log and the payload store measure is honest:
# ids from a real vocabulary (Qwen2.5's; ids need 18 bits, as a real model's do), by rank-frequency
# as text has them (Zipf, exponent 1: ids drawn as V**u - 1), and each a float32 log probability of
# its own (a sampled token's negative log likelihood, exponential with this mean in nats), never one
# constant a compressor would fold away.
ZERO_WORK_VOCAB = 151_936
ZERO_WORK_MEAN_NLL = 0.6
# The text a token reads as: a piece per id of 1..8 bytes, about 4 on average (what English text
# averages per token in a modern tokenizer), fixed for a vocabulary.
PIECE_BYTES = 8
# Zero work draws its tokens once, a pool of this many per vocabulary, and slices a call's from it
# (`TokenPool`; 512 Ki tokens: about 40 MB of Python ints and floats in each agent process, and 4 MB
# of the same as arrays).
POOL_TOKENS = 1 << 19
# The agent's promise (`mount_participant(heartbeat_s=...)`): a live try reports progress at least this
# often, from inside a model call (waiting for the model thread, or a call's simulated duration) too.
HEARTBEAT_S = 0.5


async def working(seconds: float, heartbeat: Heartbeat) -> None:
    """`seconds` of work (a model call's or a tool's), with a heartbeat every HEARTBEAT_S."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while (left := end - loop.time()) > 0:
        await asyncio.sleep(min(left, HEARTBEAT_S))
        heartbeat()


async def beating(future: Awaitable[Any], heartbeat: Heartbeat) -> Any:
    """Awaits `future` (a model call queued behind others on the model thread), with heartbeats."""
    task = asyncio.ensure_future(future)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=HEARTBEAT_S)
            if done:
                return task.result()
            heartbeat()
    finally:
        task.cancel()  # a retire cancels the try: the queued call goes with it


def episode_seed(agent_seed: int, rollout_id: str, lineage: str, turn: int | None = None) -> int:
    """The seed of a lineage's episode (`turn` None: its length) or of one of its turns."""
    where = "" if turn is None else f"|{turn}"
    digest = hashlib.sha256(f"episode|{agent_seed}|{rollout_id}|{lineage}{where}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # torch seeds must fit a signed 64-bit integer


# What a turn boundary saves (`RunSession.commit_turn`) and a resumed try carries on from.
CommitTurn = Callable[[int, dict[str, Any], Sequence[ResourceRevision]], Awaitable[ContinuationRef | None]]


def draw_ids(seed: int, n: int, vocab_size: int) -> list[int]:
    """`n` token ids drawn uniformly from `seed` (one torch call: a 32,000-token prompt costs about a
    millisecond, where drawing each from Python's random costs twenty)."""
    generator = torch.Generator().manual_seed(seed)
    ids: list[int] = torch.randint(vocab_size, (n,), generator=generator).tolist()
    return ids


def draw_like_text(seed: int, n: int, vocab_size: int) -> tuple[list[int], list[float]]:
    """Zero work's `n` tokens of a model call from `seed`: ids by rank-frequency (Zipf) and each
    one's float32 log probability, drawn in two torch calls."""
    generator = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    ids = (torch.pow(float(vocab_size), u).long() - 1).clamp_(0, vocab_size - 1)
    nll = torch.empty(n, dtype=torch.float32).exponential_(1 / ZERO_WORK_MEAN_NLL, generator=generator)
    return ids.tolist(), nll.neg_().tolist()


@functools.cache
def pieces_of(vocab_size: int) -> Pieces:
    """One piece table per vocabulary in the process (1.2 MB at a real vocabulary's size)."""
    return Pieces(vocab_size)


@functools.cache
def pool_of(vocab_size: int) -> TokenPool:
    """One zero-work pool per vocabulary in the process, drawn on first use."""
    return TokenPool(vocab_size)


def as_ids(tokens: Sequence[int]) -> npt.NDArray[np.int64]:
    """Token ids as an array: packed by `struct` in one C call (twice as fast as `np.fromiter` from a
    list), in int64 when one is past 32 bits."""
    n = len(tokens)
    try:
        return np.frombuffer(struct.pack(f"<{n}I", *tokens), dtype=np.uint32).astype(np.int64)
    except struct.error:
        return np.fromiter(tokens, dtype=np.int64, count=n)


class Pieces:
    """Each token id's text, a piece of 1..PIECE_BYTES lower-case letters (the first a space about
    half the time), drawn once per vocabulary from a fixed seed; a call's text is its pieces joined,
    gathered as one array (no Python object per token)."""

    def __init__(self, vocab_size: int) -> None:
        rng = np.random.default_rng(vocab_size)
        table = rng.integers(ord("a"), ord("z") + 1, size=(vocab_size, PIECE_BYTES), dtype=np.uint8)
        table[rng.random(vocab_size) < 0.5, 0] = ord(" ")
        # 1..8 bytes, 4 on average (a binomial around the mean, never empty); the rest of a row is
        # zero bytes, which the join deletes.
        lengths = 1 + rng.binomial(PIECE_BYTES - 1, 3 / (PIECE_BYTES - 1), size=vocab_size)
        table[np.arange(PIECE_BYTES) >= lengths[:, None]] = 0
        self.table = table
        self.lengths = lengths

    def text(self, ids: npt.NDArray[np.int64]) -> str:
        return self.table[ids].tobytes().translate(None, b"\0").decode("ascii")


class TokenPool:
    """Zero work's tokens, drawn once per vocabulary (POOL_TOKENS of them, by `draw_like_text` from a
    fixed seed: the same statistics) and handed out as windows: a call's `n` tokens are the pool's
    from an offset its seed draws, wrapping around at the end (ids, logprobs and text as slices, no
    draw per call).  Every token keeps its own log probability and text; the windows of a call, its
    prompt and its siblings' calls start apart (a pool of half a million tokens against calls of
    thousands), so each payload holds no repeat a compressor could fold that a real model's would
    not.  The pool is kept twice, as lists (a record's fields) and as uint32 / float32 arrays of the
    same values (`arrays`: what its token records are encoded and digested from, no Python number
    packed per token)."""

    def __init__(self, vocab_size: int, size: int = POOL_TOKENS) -> None:
        self.size = size
        self.ids, self.logprobs = draw_like_text(vocab_size, size, vocab_size)
        self.id_array = np.asarray(self.ids, dtype=np.uint32)
        # Each logprob was drawn as a float32: the array holds exactly the list's values.
        self.logprob_array = np.asarray(self.logprobs, dtype=np.float32)
        ids = self.id_array.astype(np.int64)
        pieces = pieces_of(vocab_size)
        self.text_bytes = pieces.table[ids].tobytes().translate(None, b"\0")
        # Where each token's text starts in `text_bytes` (and the end, at `size`).
        self.starts = np.concatenate(([0], np.cumsum(pieces.lengths[ids]))).tolist()

    def offset(self, seed: int) -> int:
        return random.Random(seed).randrange(self.size)

    def _spans(self, start: int, n: int) -> Iterator[tuple[int, int]]:
        while n > 0:
            take = min(n, self.size - start)
            yield start, start + take
            n -= take
            start = 0

    def window(self, seed: int, n: int) -> tuple[list[int], list[float], int]:
        """`n` tokens from the offset `seed` draws: ids, logprobs, and the offset (for `text`)."""
        start = self.offset(seed)
        if start + n <= self.size:  # one slice, no copy into a list of the window's own
            return self.ids[start : start + n], self.logprobs[start : start + n], start
        ids: list[int] = []
        logprobs: list[float] = []
        for a, b in self._spans(start, n):
            ids += self.ids[a:b]
            logprobs += self.logprobs[a:b]
        return ids, logprobs, start

    def arrays(self, start: int, n: int) -> tuple[npt.NDArray[np.uint32], npt.NDArray[np.float32]]:
        """The ids and logprobs of the `n` tokens from `start` as arrays (views unless they wrap)."""
        if start + n <= self.size:
            return self.id_array[start : start + n], self.logprob_array[start : start + n]
        spans = list(self._spans(start, n))
        return (
            np.concatenate([self.id_array[a:b] for a, b in spans]),
            np.concatenate([self.logprob_array[a:b] for a, b in spans]),
        )

    def text(self, start: int, n: int) -> str:
        """The text of the `n` tokens from `start`: `Pieces.text` of their ids, sliced."""
        return b"".join(
            self.text_bytes[self.starts[a] : self.starts[b]] for a, b in self._spans(start, n)
        ).decode("ascii")


def prompt_ids(
    agent_seed: int,
    request: RunRequest,
    vocab_size: int,
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
    *,
    like_text: bool = False,
) -> list[int]:
    """The task's prompt: its length drawn around `prompt_tokens`, its ids from the task's payload
    (uniform, or `like_text` as zero work draws them)."""
    seed, n = prompt_draw(agent_seed, request, prompt_tokens)
    return pool_of(vocab_size).window(seed, n)[0] if like_text else draw_ids(seed, n, vocab_size)


def prompt_draw(agent_seed: int, request: RunRequest, prompt_tokens: int) -> tuple[int, int]:
    """The seed and length of the task's prompt, from its payload (what `prompt_ids` draws from)."""
    payload = canonical_json(
        {"responses_create_params": request.responses_create_params, **request.task_fields()}
    )
    digest = hashlib.sha256(f"prompt|{agent_seed}|{payload}".encode()).digest()
    n = random.Random(digest).randint(*size_range(prompt_tokens))
    return int.from_bytes(digest[:8], "big") >> 1, n


class EpisodeTooLong(ValueError):
    """The policy cannot hold the longest episode these sizes may draw (the agent refuses to start
    rather than cut prompts)."""


def longest_context(prompt_tokens: int, gen_tokens: int, turns: tuple[int, int]) -> int:
    """The most tokens an episode's last model call may hold: the longest prompt, every earlier
    call's longest generation and tool observation, and its own longest generation."""
    calls = turns[1]
    generation = size_range(gen_tokens)[1]
    return size_range(prompt_tokens)[1] + (calls - 1) * (generation + OBSERVATION_LEN[1]) + generation


def check_fits(max_seq_len: int, prompt_tokens: int, gen_tokens: int, turns: tuple[int, int]) -> None:
    """EpisodeTooLong (one line) unless a policy of `max_seq_len` holds the longest episode."""
    longest = longest_context(prompt_tokens, gen_tokens, turns)
    if longest > max_seq_len:
        raise EpisodeTooLong(
            f"--prompt-tokens {prompt_tokens}, --gen-tokens {gen_tokens} and --turns {turns[0]}:{turns[1]} "
            f"draw up to {longest:,} tokens of context; the policy holds {max_seq_len}: lower them, "
            "or run --zero-work"
        )


def episode_reward(generated: Sequence[int] | npt.NDArray[np.uint32]) -> float:
    """Share of generated tokens with an even id: a pure function of the tokens (and not a constant
    under zero work's rank-frequency draw, where a share of the lower half would be), counted as an
    array (given as one, or packed from the list)."""
    if len(generated) == 0:
        return 0.0
    ids = generated if isinstance(generated, np.ndarray) else as_ids(generated)
    return round(float(ids.size - np.count_nonzero(ids & 1)) / ids.size, 6)


class EpisodeState(BaseModel):
    """An episode at a turn boundary: what a continuation carries (the token records go beside it)."""

    model_config = ConfigDict(extra="forbid")

    n_turns: int = Field(ge=1)
    turns_done: int = Field(ge=0)
    # The policy's context so far: the prompt, each call's generation and each tool's observation.
    context: list[int]
    output: list[dict[str, Any]] = Field(default_factory=list)
    generated: list[int] = Field(default_factory=list)


class Environment:
    """Plays one episode per try; model calls run on `executor` so the event loop never blocks on torch."""

    def __init__(
        self,
        policy: Policy,
        executor: Executor,
        *,
        seed: int,
        turns: tuple[int, int],
        temperature: float = 1.0,
        delay_s: float = 0.0,
        zero_work: bool = False,
        inline_tokens: bool = False,
        call_seconds: Durations | None = None,
        tool_seconds: Durations | None = None,
        tools: ToolBelt | None = None,
        prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
        gen_tokens: int = DEFAULT_GEN_TOKENS,
    ) -> None:
        # Every model call is sent the whole conversation so far, never a cut of it: a policy that
        # cannot hold the longest episode these sizes draw is refused here (zero work runs no model).
        if not zero_work:
            check_fits(policy.max_seq_len, prompt_tokens, gen_tokens, turns)
        self.policy = policy
        self.prompt_tokens = prompt_tokens
        self.gen_tokens = gen_tokens
        self.executor = executor
        self.seed = seed
        self.turns = turns
        self.temperature = temperature
        self.delay_s = delay_s
        # The agent's own work set to zero: no model call, each call's tokens drawn at its size (what a
        # throughput benchmark of the log needs; the protocol, faults and checkpoints are unchanged).
        self.zero_work = zero_work
        # The vocabulary its tokens are drawn from: the policy's, or under zero work a real model's.
        self.vocab_size = ZERO_WORK_VOCAB if zero_work else policy.vocab_size
        if zero_work:
            pool_of(self.vocab_size)  # drawn at start (0.1 s), not inside the first try
        # Each call's arrays also on its output message in the reply, as a real Gym agent answers them.
        self.inline_tokens = inline_tokens
        # How long each model call and each tool between two calls takes (drawn per call).
        self.call_seconds = call_seconds
        self.tool_seconds = tool_seconds
        # A resources server whose tools each turn calls (keyed per lineage and turn), exported at
        # each boundary and restored on a resume (docs/turns.md, Resources).
        self.tools = tools

    def _sampler(
        self,
        prompt: list[int],
        generator: torch.Generator | None,
        planned: tuple[list[int], list[float]],
        heartbeat: Heartbeat,
    ) -> SampleMore:
        """How one call's decode gets its next tokens: after the prefix, from the same generator (the
        tokens an uncut call samples), or in zero work the planned ones."""
        loop = asyncio.get_running_loop()

        async def sample_more(prefix: list[int], n: int) -> tuple[list[int], list[float]]:
            if generator is None:
                ids, logprobs = planned
                if not prefix and n == len(ids):  # the whole call at once (no cut): the planned lists
                    return ids, logprobs
                return ids[len(prefix) : len(prefix) + n], logprobs[len(prefix) : len(prefix) + n]
            sample = await beating(
                loop.run_in_executor(
                    self.executor, self.policy.sample, prompt + prefix, n, generator, self.temperature
                ),
                heartbeat,
            )
            return sample.token_ids, sample.logprobs

        return sample_more

    async def play(
        self,
        request: RunRequest,
        *,
        fault: ResolvedFault,
        at_boundary: Callable[[], Awaitable[None]],
        record: Callable[[TokenEntry], None],
        heartbeat: Heartbeat = lambda *_: None,
        lineage: str | None = None,
        resumed: dict[str, Any] | None = None,
        commit_turn: CommitTurn | None = None,
        at_cut: Cut | None = None,
        earlier: Sequence[TokenEntry] = (),
    ) -> RunReply:
        """Plays the episode from its prompt, or (`resumed`: the state a boundary saved, with
        `lineage` the continuation's, and `earlier` its token records) from the turn after that
        boundary; `commit_turn` saves each boundary before the run may park at it.  Every record's
        lineage is stamped from the conversation its call was sent (`protocol.lineage.link_call`), a
        resumed try's first new call linked to the last reused one."""
        key = capture_key(request.rollout_id, request.attempt_index)
        lineage = lineage or key
        vocab = self.vocab_size
        pieces = pieces_of(vocab)
        pool = pool_of(vocab) if self.zero_work else None
        start = 0  # where in the pool the call's tokens begin (zero work)
        # Zero work: the prompt's ids as an array while the context is the prompt alone, and every
        # generated token's (its records are encoded from these; None: from the lists).
        prompt_array: npt.NDArray[np.uint32] | None = None
        generated_arrays: list[npt.NDArray[np.uint32]] | None = None
        if resumed is not None:
            state = EpisodeState.model_validate(resumed)
        else:
            n_turns = random.Random(episode_seed(self.seed, request.rollout_id, lineage)).randint(*self.turns)
            if pool is not None:
                prompt_seed, prompt_len = prompt_draw(self.seed, request, self.prompt_tokens)
                first, _, prompt_start = pool.window(prompt_seed, prompt_len)
                prompt_array = pool.arrays(prompt_start, prompt_len)[0]
                generated_arrays = []
            else:
                first = prompt_ids(self.seed, request, vocab, self.prompt_tokens)
            # Not validated again (the prompt's thousands of ids); every field given (pydantic's
            # construct inspects a default factory's signature each call).
            state = EpisodeState.model_construct(
                n_turns=n_turns, turns_done=0, context=first, output=[], generated=[]
            )
        context, output, generated, n_turns = state.context, state.output, state.generated, state.n_turns
        # The conversation each model call is sent (its lineage is stamped from it), and the calls so far.
        conversation = request_input(request.responses_create_params) + list(output)
        recorded: list[TokenEntry] = list(earlier)
        for turn in range(state.turns_done, n_turns):
            seed = episode_seed(self.seed, request.rollout_id, lineage, turn + 1)
            rng = random.Random(seed)
            generator = None if self.zero_work else torch.Generator().manual_seed(seed)
            # The turn boundary: a checkpoint parks the run here, before its next model call.
            await at_boundary()
            call_id = f"call-{turn + 1}"
            if fault.hang or fault.hang_at_turn == turn + 1:
                await asyncio.Event().wait()  # stuck inside a model call: only a retire (cancel) ends it
            # Held before the call generates anything (a queue, the time to a first token): no cut.
            held = self.delay_s + fault.delay_s
            if held > 0:
                await working(held, heartbeat)
            max_new = rng.randint(*size_range(self.gen_tokens))
            # The whole conversation so far (the constructor checked the policy holds it).
            prompt = context
            # Zero work: the call's tokens taken now from the pool at the turn's seed, handed out as
            # they are due.
            planned: tuple[list[int], list[float]] = ([], [])
            if pool is not None:
                pool_ids, pool_logprobs, start = pool.window(seed, max_new)
                planned = (pool_ids, pool_logprobs)
            token_ids, logprobs = await decode(
                max_new,
                self.call_seconds.draw(f"call|{self.seed}|{key}|{turn}")
                if self.call_seconds is not None
                else 0.0,
                self._sampler(prompt, generator, planned, heartbeat),
                call_id=call_id,
                heartbeat=heartbeat,
                at_cut=at_cut,
            )
            # Zero work's ids are the pool's from `start`: their text is sliced, not gathered.
            text = pool.text(start, len(token_ids)) if pool is not None else pieces.text(as_ids(token_ids))
            item: dict[str, Any] = {
                "type": "message",
                "id": f"msg-{key}-{turn + 1}",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
            # Built here, field by field, of values of the right types: not validated again (a
            # record's 17,000 numbers at 9k tokens), and nothing left to its defaults but what a
            # validated one leaves.
            entry = TokenEntry.model_construct(
                schema_version=TOKEN_SCHEMA_VERSION,
                rollout_id=key,
                model_call_id=call_id,
                model=MODEL_NAME,
                prompt_token_ids=prompt,
                generation_token_ids=token_ids,
                generation_log_probs=logprobs,
                # The call's own output: one item, the one that carried the token arrays.
                output_items=[item],
                token_item_index=0,
                # The last call's response is the reply's (`response.id`), as a Gym agent merges them.
                response_id=f"resp-{key}" if turn + 1 == n_turns else f"resp-{key}-{turn + 1}",
                created_at=time.time(),
            )
            if pool is not None:
                generation_ids, generation_logprobs = pool.arrays(start, len(token_ids))
                entry = with_arrays(
                    entry,
                    # Later calls are sent more than the prompt: their prompts packed from the lists.
                    prompt_array.data if prompt_array is not None and turn == 0 else None,
                    generation_ids.data,
                    generation_logprobs.data,
                )
                if generated_arrays is not None:
                    generated_arrays.append(generation_ids)
            recorded.append(link_call(entry, list(conversation), recorded))
            record(recorded[-1])
            conversation.append(item)
            output.append(item)
            last = turn + 1 == n_turns
            # The lists of a turn are only what the next turn (its prompt) and a boundary's state
            # need: after the last call neither comes, and the reward is counted on the arrays when
            # zero work keeps them (two copies of the call's 9,000 numbers a try at 9k, then freed).
            if not (last and generated_arrays is not None):
                generated += token_ids
            if not last:
                context = context + token_ids
                observation = [rng.randrange(vocab) for _ in range(rng.randint(*OBSERVATION_LEN))]
                observed = {
                    "type": "function_call_output",
                    "call_id": call_id,
                    "output": pieces.text(as_ids(observation)),
                }
                output.append(observed)
                conversation.append(observed)
                context = context + observation
                if self.tool_seconds is not None:
                    await working(self.tool_seconds.draw(f"tool|{self.seed}|{key}|{turn}"), heartbeat)
                # The tools' effects come after the boundary before and before the next one: a try
                # retired in between leaves mutations past its last boundary, which a resume's restore
                # undoes (and the resumed turn applies once again).
                if self.tools is not None:
                    called = await self.tools.turn(
                        request.rollout_id, lineage, turn + 1, request.attempt_index
                    )
                    output.extend(called)
                    conversation.extend(called)
                if commit_turn is not None:
                    done = EpisodeState(
                        n_turns=n_turns,
                        turns_done=turn + 1,
                        context=context,
                        output=output,
                        generated=generated,
                    )
                    touched = await self.tools.export(lineage) if self.tools is not None else ()
                    await commit_turn(turn + 1, done.model_dump(mode="json"), touched)

        response: dict[str, Any] = {
            "id": f"resp-{key}",
            "object": "response",
            "model": MODEL_NAME,
            "status": "completed",
            # As a real Gym agent answers them, each call's arrays on its message too (`--inline-tokens`).
            "output": with_token_arrays(output, recorded) if self.inline_tokens else output,
            "metadata": {"policy_version": self.policy.policy_version, "model_calls": n_turns},
        }
        if generated_arrays is None:
            reward = episode_reward(generated)
        else:  # one call's array as it is, a multi-turn try's joined
            reward = episode_reward(
                generated_arrays[0] if len(generated_arrays) == 1 else np.concatenate(generated_arrays)
            )
        mask = False
        failure: dict[str, Any] = {}
        if fault.fail:
            response["status"] = "failed"
            response["error"] = {
                "code": "environment_error",
                "message": "environment failed (injected fault)",
            }
            reward, mask = 0.0, True
            # Named as a Gym environment names its own failures: `<server>:<kind>`.
            failure = {
                "failure_kind": "reference_agent:environment_failed",
                "failure_reason": "environment failed (injected fault)",
            }
        # The row's own fields come back at the top level, as a Gym resources server echoes its request.
        echoed = {k: v for k, v in request.task_fields().items() if k not in RunReply.model_fields}
        return RunReply(
            **echoed,
            rollout_id=request.rollout_id,
            attempt_index=request.attempt_index,
            responses_create_params=request.responses_create_params,
            id=f"r-{key}",
            response=response,
            reward=reward,
            mask_sample=mask,
            **failure,
        )
