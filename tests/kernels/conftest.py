"""Kernel tests run Triton's CPU interpreter unless told otherwise.

``TRITON_INTERPRET=1`` is what a CPU user sets for the kernels (docs/testing.md), and it is set here,
in the kernel tests' own conftest, not for the whole suite.  It must be in the environment before
``triton.language`` is first imported (Triton's own ``@triton.jit`` helpers, ``tl.cdiv`` and the
reductions, are decorated then, as compiled or interpreted), as it is in such a user's shell; no
test collected before this directory imports Triton.  The kernels in ``workers.kernels`` themselves
decorate lazily (on their first launch).  ``setdefault`` lets a GPU machine run the same tests on
compiled kernels with ``TRITON_INTERPRET=0 pytest tests/kernels``.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

INTERPRET = os.environ["TRITON_INTERPRET"].lower() in ("1", "true", "on", "yes")
DEVICE = torch.device("cpu") if INTERPRET else torch.device("cuda")


@pytest.fixture
def device() -> torch.device:
    """Where the Triton kernels run: the CPU interpreter, or CUDA when TRITON_INTERPRET=0."""
    if not INTERPRET and not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET=0 and no CUDA device: the Triton kernels cannot run")
    return DEVICE


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
