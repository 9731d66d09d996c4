"""numpy where it is installed, else None: the protocol's one optional import.

A participant's core install has no numpy (the contract and the participant library need only
pydantic, FastAPI and orjson); where numpy is there, a few of the protocol's passes over large
buffers run in it (`protocol.digests._sites`, `protocol.lineage.u4_token_digest`) and give the same
answer as their pure-Python ways, which stand in without it (the tests run both)."""

from __future__ import annotations

from typing import Any

np: Any
try:
    import numpy as np
except ImportError:  # a participant's core install
    np = None

__all__ = ["np"]
