"""The reference agent's defaults that its command line shows before anything is parsed: plain values,
no pydantic and no wire models, so `ledger --help` stays light (`gym_agent.config` re-exports them)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

DEFAULT_HOST: Final = "127.0.0.1"
TOKEN_ENV: Final = "LEDGER_GYM_TOKEN"


def cache_home() -> Path:
    """This project's folder under the user's cache ($XDG_CACHE_HOME, else ~/.cache)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rollout-ledger"


def default_state_dir(name: str) -> Path:
    """Where an agent keeps its generation counter and checkpoint artefacts unless told otherwise."""
    return cache_home() / "gym-agent" / name
