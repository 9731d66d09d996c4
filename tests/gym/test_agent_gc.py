"""`gym_agent.server.tune_gc`, what `run_server` sets the collector to before it serves, in a process
of its own (the collector is the process's)."""

from __future__ import annotations

import subprocess
import sys

_SCRIPT = """
import gc
from gym_agent.server import GC_YOUNG_THRESHOLD, tune_gc

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
