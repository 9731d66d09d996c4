"""The cyclic garbage collector as both sides' long-lived processes set it (the trainer's event loop,
`trainer.eventloop.run_async`; the reference agent, `gym_agent.server.run_server`): one setting, here
below both, because the agent may not import the trainer.

What starting built (modules, classes, an agent's app and zero work's pool) lives as long as the
process: frozen out of the collector's generations, so a full collection walks only what the work
allocates.  And the youngest generation is collected every `GC_YOUNG_THRESHOLD` allocations, not
every 700: the work makes little cyclic garbage, while a try at 9k tokens holds lists of 17,000
numbers that every collection reaching them walks item by item (docs/performance.md: the trainer's
collector CPU in a 9k soak 0.53 -> 0.16 s; both agents per sealed rollout 2.09/2.11 -> 1.92/1.94 ms).
"""

from __future__ import annotations

import gc
from typing import Final

# Allocations (minus deallocations) between two collections of the youngest generation (Python's
# default is 700).
GC_YOUNG_THRESHOLD: Final = 10_000


def tune_gc() -> None:
    """Collects once (garbage frozen would never be freed), freezes what is alive now out of later
    collections, and collects the youngest generation every `GC_YOUNG_THRESHOLD` allocations (the
    older generations' ratios are left as they are)."""
    gc.collect()
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, oldest)
