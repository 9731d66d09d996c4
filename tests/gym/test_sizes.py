"""The reference agent's sizes: prompts and generations drawn around their means (seeded), the whole
conversation sent to each call, and a policy that cannot hold an episode refused, never cut."""

from __future__ import annotations

import array
import asyncio
import itertools
import statistics
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from typer.testing import CliRunner

from cli.main import app as ledger_app
from gym_agent import cli as gym_cli
from gym_agent.episode import (
    ZERO_WORK_VOCAB,
    Environment,
    EpisodeTooLong,
    TokenPool,
    as_ids,
    check_fits,
    episode_reward,
    pieces_of,
)
from gym_agent.faults import NO_FAULT
from gym_agent.sizes import parse_turns, size_range
from protocol.lineage import token_digest
from protocol.token_codec import encode_entries, encode_records
from protocol.wire import RunRequest, TokenEntry
from workers.policy import load_policy


def play(env: Environment, tries: int) -> list[list[TokenEntry]]:
    async def noop() -> None:
        return None

    async def all_tries() -> list[list[TokenEntry]]:
        out = []
        for i in range(tries):
            records: list[TokenEntry] = []
            request = RunRequest(rollout_id=f"p{i}_g0", attempt_index=0, sample_id=f"p{i}")
            await env.play(request, fault=NO_FAULT, at_boundary=noop, record=records.append)
            out.append(records)
        return out

    return asyncio.run(all_tries())


def test_zero_work_draws_real_sizes_around_the_means_and_sends_each_call_the_whole_conversation() -> None:
    policy = load_policy("tiny")
    with ThreadPoolExecutor(max_workers=1) as executor:
        env = Environment(
            policy, executor, seed=3, turns=(3, 3), zero_work=True, prompt_tokens=3000, gen_tokens=900
        )
        episodes = play(env, 12)
        again = play(env, 1)
    assert [r.prompt_token_ids for r in again[0]] == [r.prompt_token_ids for r in episodes[0]]  # seeded
    prompts = [e[0].prompt_token_ids for e in episodes]
    generations = [len(r.generation_token_ids) for e in episodes for r in e]
    assert all(2000 <= len(p) <= 4000 for p in prompts) and len({len(p) for p in prompts}) > 1
    assert all(600 <= n <= 1200 for n in generations) and len(set(generations)) > 1
    assert 2500 < statistics.fmean(len(p) for p in prompts) < 3500
    assert 750 < statistics.fmean(generations) < 1050
    for episode in episodes:
        assert len(episode) == 3
        for before, call in itertools.pairwise(episode):
            # the next call's prompt is this one's, its generation, then the tool's observation
            sent = before.prompt_token_ids + before.generation_token_ids
            assert call.prompt_token_ids[: len(sent)] == sent
            assert len(call.prompt_token_ids) > len(sent)
        assert all(0 <= t < ZERO_WORK_VOCAB for r in episode for t in r.generation_token_ids)


def test_zero_work_tokens_look_like_a_real_models() -> None:
    """What the payload store measures is honest: ids of a real vocabulary by rank-frequency, a float32
    log probability of each token's own, and about four bytes of text per token."""
    policy = load_policy("tiny")
    with ThreadPoolExecutor(max_workers=1) as executor:
        env = Environment(
            policy, executor, seed=5, turns=(1, 1), zero_work=True, prompt_tokens=900, gen_tokens=3000
        )
        episodes = play(env, 4)
    records = [r for e in episodes for r in e]
    ids = [t for r in records for t in (*r.prompt_token_ids, *r.generation_token_ids)]
    logprobs = [v for r in records for v in r.generation_log_probs]
    # beyond 16 bits (a real vocabulary), and frequent ids frequent: the low ranks hold most tokens
    assert max(ids) >= 2**16 and max(ids) < ZERO_WORK_VOCAB
    assert sum(t < 1000 for t in ids) > len(ids) / 2 and len(set(ids)) > len(ids) / 10
    assert all(v < 0 for v in logprobs) and len(set(logprobs)) > len(logprobs) * 0.9
    assert array.array("f", logprobs).tolist() == logprobs  # each exactly a float32, as a server sends
    assert 0.3 < statistics.fmean(logprobs) * -1 < 1.0
    texts = [r.output_items[0]["content"][0]["text"] for r in records]
    per_token = sum(len(t) for t in texts) / sum(len(r.generation_token_ids) for r in records)
    assert 3.5 < per_token < 4.5, per_token
    # the reward is a pure function of the tokens, and not a constant under this draw
    assert episode_reward([2, 4, 5]) == 0.666667
    assert len({episode_reward(r.generation_token_ids) for r in records}) == len(records)


def test_zero_work_slices_its_pool_and_each_window_reads_as_its_ids() -> None:
    """The pool is drawn once and sliced: a window's text is exactly its ids' pieces, also across the
    pool's end (it wraps) and for a window longer than the pool; a seed gives one window."""
    pool = TokenPool(ZERO_WORK_VOCAB, size=5000)
    pieces = pieces_of(ZERO_WORK_VOCAB)
    for seed, n in ((1, 10), (2, 4000), (3, 4999), (4, 12_345)):
        ids, logprobs, start = pool.window(seed, n)
        assert len(ids) == len(logprobs) == n
        assert (ids, logprobs, start) == pool.window(seed, n)  # seeded
        assert ids[0] == pool.ids[start] and logprobs[0] == pool.logprobs[start]
        assert pool.text(start, n) == pieces.text(as_ids(ids))
        assert pool.text(start, n // 2) == pieces.text(as_ids(ids[: n // 2]))  # a cut call's prefix
    wrapped, _, start = pool.window(next(s for s in range(100) if pool.offset(s) > 4000), 2000)
    assert wrapped == pool.ids[start:] + pool.ids[: 2000 - (5000 - start)]
    # ids past 32 bits are converted as well (a policy's, not the pool's)
    assert as_ids([2**40, 1]).tolist() == [2**40, 1]


def test_a_policy_that_cannot_hold_the_episode_is_refused_in_one_line_not_cut() -> None:
    policy = load_policy("tiny")
    with ThreadPoolExecutor(max_workers=1) as executor:
        with pytest.raises(EpisodeTooLong, match="the policy holds 256") as refused:
            Environment(policy, executor, seed=0, turns=(1, 1), prompt_tokens=300, gen_tokens=6)
        assert "\n" not in str(refused.value)
        # the longest prompt (16) + two calls' generations (8) and one observation (6): 38 tokens fit
        check_fits(38, 12, 6, (2, 2))
        with pytest.raises(EpisodeTooLong):
            check_fits(37, 12, 6, (2, 2))
        # in policy mode the sizes that fit play with every prompt whole
        env = Environment(policy, executor, seed=0, turns=(2, 2), prompt_tokens=150, gen_tokens=3)
        episodes = play(env, 2)
    for episode in episodes:
        assert 100 <= len(episode[0].prompt_token_ids) <= 200
        for before, call in itertools.pairwise(episode):
            assert call.prompt_token_ids[: len(before.prompt_token_ids)] == before.prompt_token_ids


def test_the_size_options_are_checked_in_one_line_by_the_agent_and_by_simulate() -> None:
    runner = CliRunner()
    for bad, message in (
        (["--prompt-tokens", "0"], "want a mean between 1"),
        (["--gen-tokens", "2000000"], "want a mean between 1"),
        (["--prompt-tokens", "900"], "the policy holds 256"),
        (["--turns", "0:2"], "want 1 <= A <= B"),
    ):
        agent = runner.invoke(gym_cli.app, ["serve", "--name", "x", "--port", "0", *bad])
        simulate = runner.invoke(ledger_app, ["simulate", *bad])
        for result in (agent, simulate):
            assert result.exit_code == 2, (bad, result.output)
            assert message in " ".join(result.output.split()), (bad, result.output)
            assert "Traceback" not in result.output


def test_one_definition_of_the_sizes() -> None:
    assert size_range(12) == (8, 16) and size_range(2) == (1, 3) and size_range(1) == (1, 1)
    assert parse_turns("4") == (4, 4) and parse_turns("1:3") == (1, 3)
    with pytest.raises(ValueError, match="is not A:B"):
        parse_turns("x")


def test_zero_work_records_are_encoded_from_the_pools_arrays_with_their_lists_bytes() -> None:
    """Zero work hands its records' arrays over as the pool holds them (the first call's prompt, every
    generation): the frame and the lineage digests are those of the records' own lists, field for
    field, also past the pool's end and for later calls (whose prompts are packed from the lists)."""
    policy = load_policy("tiny")
    with ThreadPoolExecutor(max_workers=1) as executor:
        env = Environment(
            policy, executor, seed=7, turns=(2, 3), zero_work=True, prompt_tokens=900, gen_tokens=700
        )
        episodes = play(env, 6)
    # the arrays are the lists' values, also where a window wraps around the pool's end
    small = TokenPool(ZERO_WORK_VOCAB, size=1000)
    for seed, n in ((11, 2500), (12, 10)):
        ids, logprobs, start = small.window(seed, n)
        window_ids, window_logprobs = small.arrays(start, n)
        assert window_ids.tolist() == ids and window_logprobs.tolist() == logprobs
    for episode in episodes:
        packed = [r.packed_arrays() for r in episode]
        assert packed[0][0] is not None and all(p[0] is None for p in packed[1:])
        assert all(p[1] is not None and p[2] is not None for p in packed)
        as_records = [TokenEntry.model_validate(r.record()) for r in episode]
        assert (
            encode_entries(episode)
            == encode_entries(as_records)
            == encode_records([r.record() for r in episode])
        )
        for r in episode:
            assert r.digest == token_digest(r.prompt_token_ids + r.generation_token_ids)


@pytest.mark.parametrize("turns", [(1, 1), (3, 3)])
def test_zero_work_reward_is_that_of_every_generated_token_of_the_try(turns: tuple[int, int]) -> None:
    """The reward is counted over every call's generation, the last one's included, although a try's
    last turn keeps no list of the tokens generated so far (zero work counts them on its arrays)."""
    policy = load_policy("tiny")

    async def noop() -> None:
        return None

    async def tries() -> list[tuple[float, list[TokenEntry]]]:
        out = []
        for i in range(4):
            records: list[TokenEntry] = []
            request = RunRequest(rollout_id=f"r{i}_g0", attempt_index=0, sample_id=f"r{i}")
            reply = await env.play(request, fault=NO_FAULT, at_boundary=noop, record=records.append)
            out.append((reply.reward, records))
        return out

    with ThreadPoolExecutor(max_workers=1) as executor:
        env = Environment(
            policy, executor, seed=9, turns=turns, zero_work=True, prompt_tokens=300, gen_tokens=500
        )
        played = asyncio.run(tries())
    for reward, records in played:
        assert len(records) == turns[0]
        generated = [t for r in records for t in r.generation_token_ids]
        assert reward == episode_reward(generated)
        if len(records) > 1:  # the last call's tokens count: without them the share differs
            earlier = [t for r in records[:-1] for t in r.generation_token_ids]
            assert reward != episode_reward(earlier)


def test_inline_tokens_answer_each_calls_arrays_on_its_message_as_a_real_gym_agent() -> None:
    """`--inline-tokens`: the reply's output carries each call's arrays on the message that call wrote,
    so the records read back off the reply alone (`token_records_from_reply`, the participant's and
    the trainer's reader for plain Gym agents) are the agent's own records, arrays, items and
    lineage; without it no output item carries an array."""
    from protocol.tokens import TOKEN_FIELDS, token_records_from_reply

    async def noop() -> None:
        return None

    async def one(env: Environment) -> tuple[Any, list[TokenEntry]]:
        records: list[TokenEntry] = []
        request = RunRequest(rollout_id="p1_g0", attempt_index=0, sample_id="p1")
        reply = await env.play(request, fault=NO_FAULT, at_boundary=noop, record=records.append)
        return reply, records

    policy = load_policy("tiny")
    with ThreadPoolExecutor(max_workers=1) as executor:
        kw: dict[str, Any] = {
            "seed": 5,
            "turns": (3, 3),
            "zero_work": True,
            "prompt_tokens": 400,
            "gen_tokens": 300,
        }
        inline, records = asyncio.run(one(Environment(policy, executor, inline_tokens=True, **kw)))
        apart, again = asyncio.run(one(Environment(policy, executor, **kw)))
    assert [r.generation_token_ids for r in again] == [r.generation_token_ids for r in records]  # seeded
    output = apart.response["output"]
    assert not any(isinstance(i, dict) and set(TOKEN_FIELDS) & set(i) for i in output)
    carriers = [i for i in inline.response["output"] if "generation_token_ids" in i]
    assert len(carriers) == len(records) == 3
    read = token_records_from_reply(inline, records[0].rollout_id, records[0].created_at)
    fields = (
        "prompt_token_ids",
        "generation_token_ids",
        "generation_log_probs",
        "output_items",
        "parent_call_id",
        "digest",
    )
    for got, own in zip(read, records, strict=True):
        for name in fields:
            assert getattr(got, name) == getattr(own, name), name
    # Beside the arrays the reply is the one answered without them.
    stripped = [{k: v for k, v in i.items() if k not in TOKEN_FIELDS} for i in inline.response["output"]]
    assert stripped == output
