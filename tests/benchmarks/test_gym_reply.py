"""The plain Gym reply benchmark, tiny: every way is checked against its reference before it is
timed, the replies carry their calls' token arrays, and the confident share is what was asked."""

from __future__ import annotations

import math

from benchmarks import gym_reply


def test_the_cases_carry_the_arrays_and_the_share_asked_for() -> None:
    result = gym_reply.run(rollouts=2, prompt_tokens=300, gen_tokens=400, confident=0.5, rounds=1)
    drawn, confident = result["cases"].values()
    assert drawn["logprobs_above_minus_1e-4"] < 0.05
    assert 0.35 < confident["logprobs_above_minus_1e-4"] < 0.65
    for case in (drawn, confident):
        # 4 bytes or more of JSON for each token id and logprob inside the reply.
        assert case["reply_bytes"] > 4 * result["tokens_per_rollout"]
        timings = [
            *case["canonical_json_ms"].values(),
            *case["nesting_check_ms"].values(),
            *case["parse_ms"].values(),
            *case["participant_ms"].values(),
        ]
        assert all(math.isfinite(ms) and ms > 0 for ms in timings)
