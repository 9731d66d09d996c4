"""The cyclic garbage collector as both sides' long-lived processes set it (the trainer's event loop,
`trainer.eventloop.run_async`; the reference agent, `gym_agent.server.run_server`): one setting, here
below both, because the agent may not import the trainer.

What starting built (modules, classes, an agent's app and zero work's pool) lives as long as the
process: frozen out of the collector's generations, so a full collection walks only what the work
allocates.  And the youngest generation is collected once `GC_YOUNG_THRESHOLD` more containers are
alive than at the last collection, not 700: the work makes little cyclic garbage, while a try at 9k
tokens holds lists of 17,000 numbers, and a real Gym reply on the agent's side 16,000 small lists of
router choices (the trainer holds those as their text where it can: `protocol.routes`), which every
collection reaching them walks item by item, and every tenth collection of the youngest
generation runs the next one, whose tenth runs a full one (docs/performance.md: the trainer's
collector CPU in a 9k soak 0.53 -> 0.16 s at 10,000; against a real Gym agent at 9k, 0.59-0.67 s ->
0.29-0.33 s for 200 rollouts at 50,000).  Cyclic garbage waits at most that many containers for its
collection.
"""

from __future__ import annotations

import gc
from typing import Final

# Allocations (minus deallocations) between two collections of the youngest generation (Python's
# default is 700).
GC_YOUNG_THRESHOLD: Final = 50_000


def tune_gc() -> None:
    """Collects once (garbage frozen would never be freed), freezes what is alive now out of later
    collections, and collects the youngest generation every `GC_YOUNG_THRESHOLD` allocations (the
    older generations' ratios are left as they are)."""
    gc.collect()
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, oldest)
