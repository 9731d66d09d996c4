"""A coordinator's stop is said once: one line in the trainer's log for a library user however many
groups it ends, and none while a caller that reports the stop itself holds `said_by_caller` (the
CLI's one `error:` line: tests/cli/test_simulate_payload_faults.py, test_simulate_signals.py)."""

from __future__ import annotations

import logging

import pytest

from eventstore import EventStore
from eventstore.payload_stores import payload_plane
from payloads import LocalDirPayloadStore
from tests.rollout.conftest import PAYLOAD, PROMPT, MakeAgent, coordinator, gid
from trainer.errors import CoordinatorStopped, FencedOff
from trainer.gym import GymClient
from trainer.stops import log_stop, said_by_caller


def _stop_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "trainer" and "stops:" in r.getMessage()]


async def test_a_payload_store_refusing_puts_is_one_stop_line_for_every_group_it_ends(
    sqlite_store: EventStore, make_agent: MakeAgent, caplog: pytest.LogCaptureFixture
) -> None:
    target = payload_plane(sqlite_store).default
    assert isinstance(target, LocalDirPayloadStore)
    target.root.mkdir(parents=True, exist_ok=True)
    (target.root / "sha256").write_bytes(b"")  # where the shards go: every put is refused for good
    caplog.set_level(logging.ERROR, logger="trainer")
    agent = make_agent("a")
    async with GymClient(agent.url, "a") as client:
        coord = coordinator(sqlite_store, {"a": client}, mode="sibling", rollout_timeout_s=60.0)
        async with coord:
            groups = [gid() for _ in range(3)]
            for g in groups:
                await coord.submit(g, PROMPT, "a", 2, PAYLOAD)
            with pytest.raises(CoordinatorStopped, match="refused to store payloads"):
                await coord.wait_idle(120)
            assert set(groups) <= set(coord.ledger.groups)  # all three were open when it stopped
    [line] = _stop_lines(caplog)
    assert line.startswith("group ") and "refused to store payloads" in line, line


def test_a_caller_that_says_the_stop_itself_leaves_the_log_line_out(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="trainer")
    stopped = CoordinatorStopped("the log has been unavailable for more than 30 s; the coordinator stopped")
    fenced = FencedOff("another coordinator appended to trainer-T")
    with said_by_caller():
        log_stop("group p1", stopped)
        log_stop(
            "group p2", fenced
        )  # the CLI says a fenced-off stop too (tests/cli/test_simulate_signals.py)
    log_stop("group p3", stopped)  # outside: a library user's lines
    log_stop("group p4", fenced)
    assert _stop_lines(caplog) == [f"group p3 stops: {stopped}", f"group p4 stops: {fenced}"]
