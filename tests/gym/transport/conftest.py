"""The transport's cases run on asyncio's loop and on uvloop's (the trainer's): their transports differ."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from trainer.eventloop import loop_factory


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {"asyncio": asyncio.new_event_loop}
    trainer_loop = loop_factory()
    if trainer_loop is not None:
        factories["uvloop"] = trainer_loop
    return factories
