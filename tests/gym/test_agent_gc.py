"""`protocol.collector.tune_gc`, what the agent's `run_server` sets the collector to before it serves
(the trainer's `run_async` too: tests/core/test_trainer_gc.py), in a process of its own (the collector
is the process's)."""

from __future__ import annotations

import subprocess
import sys

_SCRIPT = """
import gc
import gym_agent.server
from protocol.collector import GC_YOUNG_THRESHOLD, tune_gc

assert gym_agent.server.tune_gc is tune_gc  # run_server's own

before = gc.get_threshold()
setup = [object() for _ in range(3)]  # alive before the agent serves: frozen with the rest
tune_gc()
assert before[0] != GC_YOUNG_THRESHOLD, before
assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, before[1], before[2]), (gc.get_threshold(), before)
assert gc.get_freeze_count() > 1000, gc.get_freeze_count()  # the modules and classes it had made
print("ok")
"""


def test_the_agent_freezes_its_setup_and_raises_the_young_threshold() -> None:
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
