"""Fixtures of the logprob worker tests: a policy, a store on each backend, few torch threads."""

from __future__ import annotations

import os

# Triton's CPU interpreter, as a CPU user sets it for the kernels (docs/testing.md), before Triton's
# first import (tests/kernels/conftest.py says why): `backend="auto"` takes the Triton kernel here.
os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Iterator

import pytest
import torch

from eventstore import EventStore, open_store
from workers.policy import Policy, load_policy


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    # The tiny model is latency-bound; on a busy 2-core machine extra threads only contend.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def policy() -> Policy:
    return load_policy("tiny")


@pytest.fixture(scope="session")
def other_policy() -> Policy:
    """A changed policy: other weights, hence another version."""
    return load_policy("tiny:seed=1")


@pytest.fixture
def store(store_url: str) -> Iterator[EventStore]:
    s = open_store(store_url)
    yield s
    s.close()
