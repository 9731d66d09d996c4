"""`trainer.eventloop.run_async` sets the collector for a trainer's work (`tune_gc`), in a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_SCRIPT = """
import gc
from protocol.collector import GC_YOUNG_THRESHOLD
from trainer.eventloop import run_async

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


_CYCLES_SCRIPT = """
import gc
import weakref
from protocol.collector import GC_YOUNG_THRESHOLD
from trainer.eventloop import run_async


class Node:
    pass


async def main():
    young = []
    gc.callbacks.append(lambda phase, info: phase == "stop" and young.append(info["generation"]))
    sampled = []
    for i in range(2 * GC_YOUNG_THRESHOLD):  # cycles no reference frees: 4 containers each (2 dicts)
        a, b = Node(), Node()
        a.other, b.other = b, a
        if i % 100 == 0:
            sampled.append(weakref.ref(a))
    alive = sum(ref() is not None for ref in sampled)
    return len(young), alive, len(sampled)


collections, alive, sampled = run_async(main())
assert collections >= 1, "no collection ran"
# Garbage waits for at most GC_YOUNG_THRESHOLD containers more: a quarter of what was made here.
assert alive <= sampled // 4 + 1, (alive, sampled)
print("ok")
"""


def test_cyclic_garbage_is_collected_under_the_raised_threshold() -> None:
    """The raised threshold only delays a collection: cycles made by the work are still freed, at most
    `GC_YOUNG_THRESHOLD` containers after they became garbage."""
    done = subprocess.run([sys.executable, "-c", _CYCLES_SCRIPT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


_MALLOC_SCRIPT = """
import ctypes
import sys
from trainer.eventloop import MMAP_THRESHOLD, run_async


class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info


def mapped_for_itself(size):
    '''Whether a buffer of `size` bytes, alive, is one more mmapped block of its own.'''
    before = libc.mallinfo2().hblks
    held = bytearray(size)
    mapped = libc.mallinfo2().hblks == before + 1
    del held
    return mapped


def after_a_bigger_one_freed():
    freed = bytearray(8 << 20)
    del freed
    return mapped_for_itself(2 << 20)


async def main():
    # A try's buffers (an HTTP body, token records, a driver's copy: up to a few hundred KiB) come
    # from the heap, not each mapped and faulted in afresh; a bigger one is mapped for itself.
    return after_a_bigger_one_freed(), mapped_for_itself(256 << 10)


# glibc's dynamic threshold: freeing the mapped 8 MiB buffer raises it past 8 MiB, so the 2 MiB one
# then comes from the heap (whose high-water stays resident); pinned, it is mapped for itself.
assert 256 << 10 < MMAP_THRESHOLD < 2 << 20
if sys.argv[1] == "pinned":
    assert run_async(main()) == (True, False), "the threshold rose, or is under 256 KiB"
else:
    assert not after_a_bigger_one_freed(), "the threshold did not rise"
print("ok")
"""


def _fresh_python(script: str, *args: str, **malloc_env: str) -> str:
    """`script` run in a new interpreter with no MALLOC_* setting but `malloc_env`: what it printed
    (glibc reads its thresholds at start-up, so every case needs a process of its own)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | malloc_env
    done = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_run_async_pins_the_mmap_threshold_so_big_buffers_are_returned() -> None:
    """Freed, a buffer above the threshold is unmapped: glibc can no longer raise the threshold past
    the payloads' sizes and keep their bytes in the heap (the trainer's RSS high-water)."""
    for case in ("dynamic", "pinned"):
        assert _fresh_python(_MALLOC_SCRIPT, case) == "ok"


_TRIM_SCRIPT = """
import asyncio
import sys
from trainer.eventloop import heap_trims, run_async, trim_heap


def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


if sys.argv[1] == "trim":
    # 64 MiB of 4 KiB buffers (under the mmap threshold: from the heap), one in 64 kept: the freed
    # ones coalesce into holes of 252 KiB that glibc keeps resident, the kept ones pin the heap's top.
    buffers = [bytearray(4096) for _ in range(16384)]
    kept = buffers[::64]
    del buffers
    before = rss_kib()
    assert trim_heap(), "nothing was given back"
    after = rss_kib()
    assert before - after > 32 * 1024, (before, after)
    assert heap_trims() == 1 and len(kept) == 256
else:
    async def main():
        # run_async's timer trims without the coroutine asking; bounded, never waited on for ever.
        async with asyncio.timeout(30):
            while heap_trims() < 2:
                await asyncio.sleep(0.01)
        return heap_trims()

    assert heap_trims() == 0
    assert run_async(main(), trim_every_s=0.01) >= 2
print("ok")
"""


def test_a_heap_trim_gives_back_the_free_pages_inside_the_heap() -> None:
    """The heap's free holes (a burst of small buffers freed) stay resident until trimmed; a trim
    returns them, and run_async trims on a timer of its own."""
    for case in ("trim", "timer"):
        assert _fresh_python(_TRIM_SCRIPT, case) == "ok"


_ENV_SCRIPT = """
from trainer.eventloop import tune_malloc

print(tune_malloc())
"""


@pytest.mark.parametrize(
    ("named", "sets"),
    [
        ((), True),
        (("MALLOC_TRIM_THRESHOLD_",), True),
        (("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"), False),
    ],
)
def test_tune_malloc_leaves_to_the_environment_what_it_names(named: tuple[str, ...], sets: bool) -> None:
    """The escape hatch: a threshold the environment names is glibc's to read; with both named,
    tune_malloc sets nothing."""
    assert _fresh_python(_ENV_SCRIPT, **{name: "1048576" for name in named}) == str(sets)
