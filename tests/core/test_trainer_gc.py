"""`trainer.eventloop.run_async` sets the collector for a trainer's work (`tune_gc`), in a process of its own."""

from __future__ import annotations

import subprocess
import sys

_SCRIPT = """
import gc
from trainer.eventloop import GC_YOUNG_THRESHOLD, run_async

before = gc.get_threshold()
setup = [object() for _ in range(3)]  # alive before the loop starts: frozen with the rest


async def main():
    return gc.get_threshold(), gc.get_freeze_count()


threshold, frozen = run_async(main())
assert before[0] != GC_YOUNG_THRESHOLD, before
assert threshold == (GC_YOUNG_THRESHOLD, before[1], before[2]), (threshold, before)
assert frozen > 1000, frozen  # the modules, classes and objects the process had made
print("ok")
"""


def test_run_async_freezes_the_setup_and_raises_the_young_threshold() -> None:
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
