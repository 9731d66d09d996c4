"""A projection runner SIGKILLed at random points resumes from its stored checkpoint and ends right."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eventstore import EventStore
from projections.runner import (
    RUNNER_NAME,
    default_projections,
    latest_common_checkpoint,
    load_replay,
    rebuild,
)
from tests.projections.builder import LogBuilder
from tests.projections.simulator import Simulator

ROOT = Path(__file__).resolve().parents[2]


def start(db_url: str, every: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.projections.runner_proc", db_url, str(every)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


@pytest.mark.slow
def test_runner_killed_at_random_points_ends_like_a_rebuild(store: EventStore, db_url: str) -> None:
    rng = random.Random(20240611)
    simulator = Simulator(LogBuilder(store), rng)
    simulator.run(100)
    interrupted = 0
    for _ in range(3):
        before = store.subscriber_position(RUNNER_NAME)
        proc = start(db_url, every=5)
        deadline = time.monotonic() + 60
        # Kill it once it has stored at least one new checkpoint, a random moment later.
        while store.subscriber_position(RUNNER_NAME) == before and proc.poll() is None:
            assert time.monotonic() < deadline, "the runner made no progress"
            time.sleep(0.01)
        time.sleep(rng.uniform(0, 0.3))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if store.subscriber_position(RUNNER_NAME) < store.head():
            interrupted += 1
        simulator.run(rng.randint(5, 40))  # the log moves on while the runner is down
    assert interrupted >= 1

    proc = start(db_url, every=5)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()

    head = store.head()
    assert store.subscriber_position(RUNNER_NAME) == head
    assert latest_common_checkpoint(store, default_projections()) == head
    resumed = load_replay(store, default_projections(), head)
    assert resumed.hashes() == rebuild(store, from_checkpoint=False).hashes()
