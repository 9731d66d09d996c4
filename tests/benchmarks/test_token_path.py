"""The store-to-tensor benchmark, tiny: every path reads the same tokens back from a real payload
directory (the benchmark refuses to time paths that disagree), and its figures follow from the sizes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks import token_path
from payloads import open_payload_store


def test_every_path_gives_the_same_tokens_and_the_bytes_follow_the_sizes(tmp_path: Path) -> None:
    store = open_payload_store((tmp_path / "payloads").as_uri())
    try:
        result = token_path.run(store, rollouts=3, prompt_tokens=300, gen_tokens=200, turns=(2, 2), rounds=1)
    finally:
        store.close()
    assert list(result["paths"]) == list(token_path.PATHS)
    assert result["sha256_cpu_gb_per_s"] > 0
    for figures in result["paths"].values():
        assert all(math.isfinite(v) and v > 0 for v in figures.values()), figures
    # two calls: the prompt (200-400) and its generation (133-267), then all that again with an
    # observation, and a second generation
    tokens = result["tokens_per_rollout"]
    assert 2 * 200 + 2 * 133 + 133 <= tokens <= 2 * 400 + 3 * 267 + 6
    # the arrays: 4 bytes an id, 4 a generated token's log probability; the stored form adds the heads
    assert 4 * tokens <= result["token_bytes_per_rollout"] <= 8 * tokens
    assert result["stored_bytes_per_rollout"] > result["token_bytes_per_rollout"]
    assert 133 <= result["first_rollout_generated"] <= 2 * 267
    assert len(list((tmp_path / "payloads").rglob("*"))) >= 9  # both forms and the reply of each rollout


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--payloads", "ftp://x"], "error: unknown payload store URL 'ftp://x'"),
        (["--rollouts", "0"], "argument --rollouts: 0 is not at least 1"),
        (["--rounds", "-1"], "argument --rounds: -1 is not at least 1"),
        (["--rollouts", "many"], "argument --rollouts: 'many' is not a whole number"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(
    args: list[str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code: str | int | None
    try:
        code = token_path.main([*args, "--prompt-tokens", "10", "--gen-tokens", "10"])
    except SystemExit as exc:  # argparse's own refusal
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and says in err and "Traceback" not in err, err


def test_a_payload_store_that_is_a_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "a-file"
    target.write_bytes(b"")
    assert token_path.main(["--payloads", str(target), "--rollouts", "1", "--rounds", "1"]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: payload store {target} is not a directory"]
