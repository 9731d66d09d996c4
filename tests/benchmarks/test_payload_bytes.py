"""The payload-bytes benchmark, small: its rows follow from the stored payloads and the sizes, each
floor below the one before it, and bad arguments are one line."""

from __future__ import annotations

import pytest

from benchmarks import payload_bytes


def test_the_rows_follow_from_the_stored_payloads_and_each_floor_is_below_the_last() -> None:
    result = payload_bytes.run(rollouts=3, prompt_tokens=600, gen_tokens=300, turns=(1, 1), siblings=4)
    rows = result["bytes_per_token"]
    assert list(rows) == list(payload_bytes.ROWS)
    assert result["id_bits"] == 18  # a 151,936-token vocabulary
    assert rows["stored"] == pytest.approx(rows["  token records"] + rows["  reply"], abs=0.002)
    # the arrays as stored: a u4 id a token, an f4 log probability a generated one (a third of them
    # here, within the draws' spread), and nothing else
    assert 4 * (1 + 1 / 6) <= rows["arrays"] <= 4 * (1 + 1 / 2) < rows["  token records"]
    floors = [rows[name] for name in ROWS_OF_FLOORS]
    assert floors == sorted(floors, reverse=True) and len(set(floors)) == len(floors), floors
    # per token: the arrays are 4 bytes an id and 4 a log probability; the prompt's shared copies go
    # first, then each id left takes 18 bits of 32, then each log probability 2 bytes of 4
    logprobs = rows["arrays"] / 4 - 1
    ids_left = rows["+ prompt once a group"] / 4 - logprobs
    packed = rows["+ ids bit-packed"]
    assert packed == pytest.approx(rows["+ prompt once a group"] - (4 - 18 / 8) * ids_left, abs=0.005)
    assert rows["+ 16-bit logprobs (lossy)"] == pytest.approx(packed - 2 * logprobs, abs=0.005)
    assert 0.25 < ids_left < 0.9  # a quarter of the prompt (2/3 of the tokens) and the generation
    for codec in payload_bytes.CODECS:
        assert 0 < rows[codec] < rows["stored"]
        assert result["codec_cpu_ms_per_rollout"][codec] > 0


ROWS_OF_FLOORS = (
    "stored",
    "arrays",
    "+ prompt once a group",
    "+ ids bit-packed",
    "+ 16-bit logprobs (lossy)",
)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--rollouts", "0"], "argument --rollouts: 0 is not at least 1"),
        (["--siblings", "x"], "argument --siblings: 'x' is not a whole number"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(
    args: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        payload_bytes.main(args)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and says in err and "Traceback" not in err, err
