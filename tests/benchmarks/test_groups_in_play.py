"""benchmarks.groups_in_play: the two ways agree on every ledger it measures, and its counts hold."""

from __future__ import annotations

import pytest

from benchmarks import groups_in_play


def test_the_index_and_the_scan_agree_and_the_handed_out_groups_are_the_unclaimed_ones() -> None:
    samples = groups_in_play.sample_groups()
    assert {g.status for g in samples} >= {"sealed"}
    state = groups_in_play.ledger_of(samples, 300, 20)
    assert len(state.groups) == 300
    handed_out, *timings = groups_in_play.measure(state)  # asserts the scan equals the index
    assert handed_out == 20 and state.sealed_unclaimed_ids() == [f"g{i}" for i in range(20)]
    assert all(t > 0 for t in timings)


@pytest.mark.parametrize("args", [["--in-play", "0"], ["--in-play", "10", "--handed-out", "20"]])
def test_bad_counts_are_one_line_and_exit_2(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        groups_in_play.main(args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "error:" in err[-1] and "at least" in err[-1], err
