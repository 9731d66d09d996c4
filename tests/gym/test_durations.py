"""The reference agent's model-call and tool durations: drawn per call from a gamma distribution
(gym_agent.durations), spent inside the call or between calls as the participant measures them."""

from __future__ import annotations

import statistics

import pytest
from typer.testing import CliRunner

from gym_agent.cli import app
from gym_agent.durations import Durations, parse_durations
from tests.gym.conftest import MakeAgent, fresh_id, run_request
from trainer.gym import GymClient


def test_draws_have_the_mean_and_spread_asked_and_repeat_per_call() -> None:
    d = Durations(mean_s=20.0, spread_s=5.0)
    draws = [d.draw(f"call-{i}") for i in range(4000)]
    assert abs(statistics.fmean(draws) - 20.0) < 0.5
    assert abs(statistics.stdev(draws) - 5.0) < 0.5
    assert min(draws) > 0 and max(draws) < d.longest_s() + 5
    assert d.draw("call-7") == draws[7]  # seeded by the call it is for
    assert len(set(draws)) == len(draws)
    assert Durations(mean_s=3.0).draw("x") == 3.0 and Durations(mean_s=0.0, spread_s=1.0).draw("x") == 0.0


@pytest.mark.parametrize(
    ("text", "expected"), [("20", (20.0, 0.0)), ("20:5", (20.0, 5.0)), ("0.5:0", (0.5, 0.0))]
)
def test_parse(text: str, expected: tuple[float, float]) -> None:
    d = parse_durations(text)
    assert (d.mean_s, d.spread_s) == expected


@pytest.mark.parametrize("text", ["", "x", "20:", "-1", "20:-2", "nan", "inf", "1:2:3"])
def test_bad_durations_are_one_line_errors(text: str) -> None:
    with pytest.raises(ValueError, match=r"--call-seconds must be MEAN\[:SPREAD\]"):
        parse_durations(text)
    result = CliRunner().invoke(app, ["serve", "--name", "a", "--port", "0", "--call-seconds", text])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "--call-seconds must be MEAN[:SPREAD]" in " ".join(result.output.split())


async def test_call_time_is_model_time_and_tool_time_is_not(make_agent: MakeAgent) -> None:
    """Two calls of 0.3 s with a 2 s tool between them: the try's model time holds both calls and not
    the tool (the receipt's work, as the participant measured it)."""
    agent = make_agent(
        "timed",
        turns=(2, 2),
        zero_work=True,
        call_seconds=Durations(mean_s=0.3),
        tool_seconds=Durations(mean_s=2.0),
    )
    async with GymClient(agent.url, "timed") as client:
        rid = fresh_id("d") + "_g0"
        await client.run(run_request(rid))
        receipt = await client.completion_receipt(rid, 0)
    assert receipt.work is not None
    assert 0.6 <= receipt.work.model_s < 2.0
