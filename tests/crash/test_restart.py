"""The crash campaign's representatives, through real process restarts: for each kind of file a Gym
process owns, the process is started as a user starts it (`ledger gym serve`, `ledger gym resources`)
on a state directory whose file a crash cut short (it starts, the torn record cut off, and what it
appends next reads back) or whose last record has a flipped bit (it exits with status 2 and one line
naming the file and the byte, the file untouched).  The exhaustive sweep runs the same recovery code
in-process (`test_campaign.py`)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from gym_agent.launcher import AgentProcess, free_port
from gym_resources.book import JOURNAL_FILE, side_effects
from participant.evidence import EVIDENCE_FILE, read_evidence
from tests.crash.campaign import Damage, Written
from tests.crash.subjects import SUBJECTS
from tests.gym.conftest import run_request
from trainer.gym import GymClient

pytestmark = pytest.mark.slow

LEDGER = str(Path(sys.executable).with_name("ledger"))


def _damaged(name: str, state: Path, damage: str) -> tuple[Written, bytes]:
    """The subject's file written into `state` by its own writer, then cut inside its last record
    (`torn`) or with a bit of its last record flipped (`flip`); returns what was written and kept."""
    subject = SUBJECTS[name]
    written = subject.build(state)
    last = written.starts[-1]
    cut = Damage("truncate", last + (len(written.data) - last) // 2)
    flip = Damage("flip", last + 20, 3)
    data = (cut if damage == "torn" else flip).apply(written.data)
    (state / written.path).write_bytes(data)
    return written, data


def _refused(command: list[str], path: Path, offset: int) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    assert "Traceback" not in done.stderr + done.stdout, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: {path}: damaged record at byte {offset}: its checksum does not match its bytes"
    ], done.stderr


def _serve(state: Path, *extra: str) -> list[str]:
    return [
        LEDGER,
        "gym",
        "serve",
        "--name",
        "a",
        "--port",
        str(free_port()),
        "--state-dir",
        str(state),
        *extra,
    ]


@pytest.mark.parametrize(
    ("name", "extra"),
    [
        (EVIDENCE_FILE, ()),
        ("continuations.jsonl", ("--turn-continuation",)),
        ("driver.json", ()),
    ],
)
def test_an_agent_refuses_to_start_on_a_flipped_bit(
    tmp_path: Path, name: str, extra: tuple[str, ...]
) -> None:
    state = tmp_path / "state"
    written, data = _damaged(name, state, "flip")
    _refused(_serve(state, *extra), state / written.path, written.starts[-1])
    assert (state / written.path).read_bytes() == data  # left as it was, for the operator


def test_an_agent_refuses_to_start_on_a_damaged_generation_file(tmp_path: Path) -> None:
    state = tmp_path / "state"
    written = SUBJECTS["generation"].build(state)
    (state / written.path).write_bytes(written.data[:2])  # "3 " of "3 <incarnation> <crc>"
    done = subprocess.run(_serve(state), capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert [e for e in done.stderr.splitlines() if e.startswith("error:")] == [
        f"error: {state / 'generation'}: damaged record at byte 0: cut short at byte 2 (no end of line)"
    ]


def test_an_agent_started_on_a_torn_evidence_record_cuts_it_and_goes_on(tmp_path: Path) -> None:
    state = tmp_path / "state"
    written, _ = _damaged(EVIDENCE_FILE, state, "torn")
    before = read_evidence(state)

    async def run_one(url: str) -> None:
        async with GymClient(url, "a") as c:
            await c.run(run_request("after_g0"))
            [ack] = await c.acknowledge([await c.completion_receipt("after_g0", 0)])
            assert ack.acknowledged

    agent = AgentProcess("a", state_dir=state, turns=(1, 1))
    try:
        agent.start()
        assert (state / EVIDENCE_FILE).read_bytes() == written.data[
            : written.starts[-1]
        ]  # the torn record cut
        asyncio.run(run_one(agent.url))
        assert agent.stop() == 0
    finally:
        agent.close()
    after = read_evidence(state)
    assert after.torn_lines == 0 and after.tries[("after_g0", 0)].acknowledged
    assert {k: after.tries[k].started for k in before.tries} == {
        k: t.started for k, t in before.tries.items()
    }


def _resources(state: Path, port: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            LEDGER,
            "gym",
            "resources",
            "--port",
            str(port),
            "--state-dir",
            str(state),
            "--log-level",
            "warning",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_the_resources_server_refuses_a_flipped_bit_and_recovers_a_torn_record(tmp_path: Path) -> None:
    state = tmp_path / "state"
    written, data = _damaged(JOURNAL_FILE, state, "flip")
    port = free_port()
    refused = _resources(state, port)
    _, err = refused.communicate(timeout=120)
    assert refused.returncode == 2 and "Traceback" not in err, err
    assert [e for e in err.splitlines() if e.startswith("error:")] == [
        f"error: {state / JOURNAL_FILE}: damaged record at byte {written.starts[-1]}: its checksum does not "
        "match its bytes"
    ]
    assert (state / JOURNAL_FILE).read_bytes() == data

    torn = Damage("truncate", len(written.data) - 5).apply(written.data)
    (state / JOURNAL_FILE).write_bytes(torn)
    server = _resources(state, port)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        with httpx.Client(base_url=url, timeout=10) as client:
            while True:
                try:
                    client.get("/resources").raise_for_status()
                    break
                except httpx.TransportError:
                    assert server.poll() is None and time.monotonic() < deadline, server.communicate()
                    time.sleep(0.1)
            key = {"rollout_id": "turns_g0", "lineage": "turns_g0", "turn": 1, "call": 0}
            repeat = client.post(
                "/resources/bank/call", json={"session": "s1", "key": key, "tool": "deposit"}
            )
            assert repeat.json()["applied"] is False  # answered from the record the journal kept
            key["turn"] = 3  # the torn record's key: never answered, so applied now, once
            fresh = {"session": "s1", "key": key, "tool": "deposit", "arguments": {"amount": 7}}
            assert client.post("/resources/bank/call", json=fresh).json()["applied"] is True
    finally:
        server.send_signal(signal.SIGTERM)
        server.communicate(timeout=30)
    effects = side_effects(state)
    assert effects.twice == [] and effects.repeats == 2
    assert (state / JOURNAL_FILE).read_bytes().startswith(written.data[: written.starts[-1]])
