"""The trainer's intake benchmark, tiny: the three ways give the same claims (the benchmark refuses
to time ways that disagree) and its figures follow from the sizes."""

from __future__ import annotations

import math

from benchmarks import token_intake


def test_every_way_gives_the_same_claims_and_the_figures_follow_the_sizes() -> None:
    result = token_intake.run(rollouts=2, prompt_tokens=300, gen_tokens=200, rounds=1)
    assert list(result["ms_per_try"]) == list(token_intake.WAYS)
    assert all(math.isfinite(v) and v > 0 for v in result["ms_per_try"].values())
    assert result["reply_alone_ms_per_try"] > 0
    tokens = result["tokens_per_rollout"]
    assert 200 + 133 <= tokens <= 400 + 267
    assert result["token_bytes_per_rollout"] >= 4 * tokens  # 4 bytes an id, 4 a logprob, the heads
