"""The reference agent's sizes: prompts and generations drawn around their means (seeded), the whole
conversation sent to each call, and a policy that cannot hold an episode refused, never cut."""

from __future__ import annotations

import asyncio
import itertools
import statistics
from concurrent.futures import ThreadPoolExecutor

import pytest
from typer.testing import CliRunner

from cli.main import app as ledger_app
from gym_agent import cli as gym_cli
from gym_agent.episode import Environment, EpisodeTooLong, check_fits
from gym_agent.faults import NO_FAULT
from gym_agent.sizes import parse_turns, size_range
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
        assert all(0 <= t < policy.vocab_size for r in episode for t in r.generation_token_ids)


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
