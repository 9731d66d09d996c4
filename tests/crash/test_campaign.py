"""Every durable file the project writes with its own code, crashed at every byte: each file truncated
at every byte prefix of its last group commit and one bit flipped at every bit of its last record, then
its owner's recovery run on it (in-process: the same code a restarted agent, server or trainer runs;
`test_restart.py` restarts the real processes).  The owner recovers exactly the records wholly
written before the damage, or refuses in one line naming the file and the byte; never anything else.

CI runs a deterministic slice (every 7th byte, each record's boundaries and last bytes, every bit of
each byte taken); `--crash-exhaustive` runs every byte (docs/testing.md, The crash campaign).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.crash import campaign
from tests.crash.subjects import SUBJECTS

STRIDE = 7


@pytest.fixture
def stride(request: pytest.FixtureRequest) -> int:
    return 1 if request.config.getoption("--crash-exhaustive") else STRIDE


def _expect_records(t: campaign.Tally) -> None:
    """An append-only file: every cut is a crash mid-write, recovered; every flip is refused but a
    flip of the last newline (the record then reads as a torn tail: recovered without it)."""
    assert t.refused + t.recovered == t.prefixes + t.flips
    assert t.recovered == t.prefixes + 8, t.row()


def _expect_whole(t: campaign.Tally) -> None:
    """A file replaced whole holds one record: every cut and every flip is refused."""
    assert (t.refused, t.recovered) == (t.prefixes + t.flips, 0), t.row()


@pytest.mark.parametrize("name", sorted(SUBJECTS))
def test_every_byte_of_the_last_records(name: str, tmp_path: Path, stride: int) -> None:
    subject = SUBJECTS[name]
    tally = campaign.run(subject, tmp_path, stride)
    print(tally.row())
    expect = _expect_records if name.endswith(".jsonl") else _expect_whole
    campaign.check(tally, expect)


def test_the_campaign_fails_a_reader_that_skips_the_checksum(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A campaign that cannot fail proves nothing: with the checksum no longer checked, a flipped bit
    in a record's value is read as a different record, and the campaign says so."""
    from participant import records

    monkeypatch.setattr(records, "_checked", lambda path, offset, line: b"{" + line[records._BODY_AT :])
    tally = campaign.run(SUBJECTS["executions.jsonl"], tmp_path, STRIDE)
    assert tally.silent and all("flipped" in s for s in tally.silent), tally.row()
    with pytest.raises(AssertionError, match=r"silent|recovered"):
        campaign.check(tally)


def test_the_campaign_fails_an_owner_that_keeps_a_torn_tail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An owner that appends after a torn last record without cutting it off glues its next record to
    the torn one: the campaign finds the file not holding exactly the recovered records."""
    from gym_resources import book

    monkeypatch.setattr(book, "cut_torn_tail", lambda reader: 0)
    tally = campaign.run(SUBJECTS["resources.jsonl"], tmp_path, STRIDE)
    assert tally.silent and all("does not hold exactly the recovered records" in s for s in tally.silent)
    assert tally.recovered == 1, tally.row()  # only the cut at the record's first byte leaves no torn tail
