"""The environment a user's shell gives a command the tests run as a subprocess.

The test process itself may hold settings a user's shell does not: the Ray tests call
`prepare_loopback()` before they import Ray (as a driver using the public API does), and the kernel and
worker tests turn Triton's interpreter on for themselves.  A command run as a user runs it gets the
test process's environment without them, so it must cope with the environment a user has.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Final

from trainer.ray_gym.local import LOOPBACK_ENV

# Put there by the tests' own setup, never by a user's shell.
SET_BY_TESTS: Final = (LOOPBACK_ENV, "TRITON_INTERPRET")


def user_env(**extra: str) -> dict[str, str]:
    """`os.environ` less what the tests set for themselves, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in SET_BY_TESTS}
    env.update(extra)
    return env


def ledger_command() -> str:
    """The `ledger` script this interpreter's environment installed (the one a user's shell finds)."""
    script = Path(sys.executable).with_name("ledger")
    if script.exists():
        return str(script)
    found = shutil.which("ledger")
    if found is None:
        raise RuntimeError("no `ledger` command is installed beside this interpreter or on PATH")
    return found
